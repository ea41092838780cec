//! Pointer checks: every dereference of a caller's pointer goes through one of these (NULL,
//! alignment, `struct_size`).

use super::*;

/// A borrowed NUL-terminated UTF-8 string.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
pub(super) unsafe fn cstr<'a>(p: *const c_char, what: &str) -> Result<&'a str, CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string valid for the call.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| invalid(format!("{what} is not valid UTF-8")))
}

/// A borrowed array of `n` elements (`p` may be NULL only when `n` is 0).
///
/// # Safety
/// When `n > 0`, `p` points to `n` initialised elements valid for the call.
pub(super) unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], CErr> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL but its count is {n}")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    if n.checked_mul(std::mem::size_of::<T>().max(1))
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(invalid(format!("{what}: count {n} is too large")));
    }
    // SAFETY: non-NULL, aligned, size in range; the caller promises n valid elements.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Checks the `struct_size` that starts every ABI struct before touching the rest.
///
/// # Safety
/// `p` is NULL or points to at least 4 readable bytes (the caller's `struct_size`), and to a
/// whole `T` if those hold `size_of::<T>()`.
pub(super) unsafe fn checked_struct<T: AbiStruct>(p: *const T, what: &str) -> Result<(), CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: non-NULL and aligned; every version of every ABI struct starts with a u32.
    let size = unsafe { std::ptr::read(p as *const u32) } as usize;
    let want = std::mem::size_of::<T>();
    if size != want {
        return Err(err(
            OBJECTCACHE_ERR_ABI_MISMATCH,
            format!(
                "{what}->struct_size is {size}, this library (ABI version {}) expects \
                 sizeof({}) = {want}; rebuild against the installed objectcache.h",
                OBJECTCACHE_ABI_VERSION,
                T::NAME
            ),
        ));
    }
    Ok(())
}

/// A borrowed input struct after its size check.
///
/// # Safety
/// As [`checked_struct`], and the struct is initialised and valid for the call.
pub(super) unsafe fn in_struct<'a, T: AbiStruct>(p: *const T, what: &str) -> Result<&'a T, CErr> {
    // SAFETY: forwarded contract.
    unsafe { checked_struct(p, what)? };
    // SAFETY: checked non-NULL, aligned and of the right size.
    Ok(unsafe { &*p })
}

/// Writes an output struct after its size check (`v.struct_size` is set here).
///
/// # Safety
/// As [`checked_struct`], and the struct is writable.
pub(super) unsafe fn out_struct<T: AbiStruct>(p: *mut T, mut v: T, what: &str) -> Result<(), CErr> {
    // SAFETY: forwarded contract.
    unsafe { checked_struct(p as *const T, what)? };
    v.set_size();
    // SAFETY: checked non-NULL, aligned and of the right size; the caller owns it writable.
    unsafe { std::ptr::write(p, v) };
    Ok(())
}

/// Writes one output value.
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
pub(super) unsafe fn out_val<T>(p: *mut T, v: T, what: &str) -> Result<(), CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    // SAFETY: non-NULL, aligned, writable by the caller's contract.
    unsafe { std::ptr::write(p, v) };
    Ok(())
}

/// Checks that an output pointer is usable before doing the work it reports.
pub(super) fn need_out<T>(p: *mut T, what: &str) -> Result<(), CErr> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is not aligned")));
    }
    Ok(())
}
