//! The engine's `cpus` setting ([`super::EngineConfig::cpus`]): pins the calling thread to a
//! CPU list with `sched_setaffinity(2)` (Linux). The engine's runtime calls it as each of its
//! threads starts; threads those threads start inherit the mask.
#![allow(unsafe_code)]

/// Pins the calling thread to `cpus` (CPU indices below [`super::config::MAX_CPUS`]).
/// The kernel leaves out CPUs the process may not use.
///
/// # Errors
/// The OS error when no CPU of the list may be used (`EINVAL`), or on systems other than
/// Linux (`Unsupported`).
pub(crate) fn pin_current_thread(cpus: &[usize]) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `cpu_set_t` is a plain bit array for which all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus {
            if c < super::config::MAX_CPUS {
                // SAFETY: `c` is below CPU_SETSIZE (1024), the number of bits in `set`.
                unsafe { libc::CPU_SET(c, &mut set) };
            }
        }
        // SAFETY: `set` is a valid, initialised `cpu_set_t` of the size passed; pid 0 is the
        // calling thread; the call only reads `set`.
        let rc =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpus;
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "CPU affinity is set only on Linux",
        ))
    }
}

/// The CPUs the calling thread may run on (Linux), in increasing order; `None` elsewhere or
/// when the call fails.
#[cfg(test)]
fn current_thread_cpus() -> Option<Vec<usize>> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `cpu_set_t` is a plain bit array for which all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid `cpu_set_t` of the size passed, which the call writes; pid
        // 0 is the calling thread.
        let rc =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if rc != 0 {
            return None;
        }
        // SAFETY: each index is below CPU_SETSIZE, the number of bits in `set`.
        Some(
            (0..super::config::MAX_CPUS)
                .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
                .collect(),
        )
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a thread of its own (the mask is per thread): pinning to one allowed CPU reads back
    /// as exactly that CPU; a list of CPUs that do not exist is refused and changes nothing.
    #[cfg(target_os = "linux")]
    #[test]
    fn pins_and_reads_back() {
        std::thread::spawn(|| {
            let all = current_thread_cpus().expect("affinity readable");
            let last = *all.last().expect("at least one CPU");
            pin_current_thread(&[last]).unwrap();
            assert_eq!(current_thread_cpus().unwrap(), vec![last]);
            let e = pin_current_thread(&[1023]).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
            assert_eq!(current_thread_cpus().unwrap(), vec![last]);
        })
        .join()
        .unwrap();
    }
}
