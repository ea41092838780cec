//! Device context: the device list, an opened `ibv_context`, port attributes and the GID
//! this end uses for RoCE addressing.

use std::ffi::CStr;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::{RdmaError, Result};

/// Which device, port and GID to use. `Default` = first device, port 1, GID chosen
/// automatically (the first RoCE v2 GID with an IPv4-mapped address, else the first non-zero).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSelector {
    /// Device name as in `ibv_devices` (`mlx5_0`, `rxe0`); `None` = the first device.
    pub device: Option<String>,
    /// Port number, 1-based.
    pub port: u8,
    /// GID table index; `None` = automatic (see the type's doc). On RoCE deployments set it to
    /// the RoCE v2 entry of the NIC's IP address (`show_gids`); see docs/rdma.md.
    pub gid_index: Option<u8>,
}

impl Default for DeviceSelector {
    fn default() -> Self {
        DeviceSelector {
            device: None,
            port: 1,
            gid_index: None,
        }
    }
}

impl DeviceSelector {
    /// Reads `OBJECTCACHE_RDMA_DEVICE`, `OBJECTCACHE_RDMA_PORT` and `OBJECTCACHE_RDMA_GID_INDEX`
    /// over the defaults.
    ///
    /// # Errors
    /// [`RdmaError::InvalidArgument`] naming the variable when a number does not parse.
    pub fn from_env() -> Result<Self> {
        let mut s = DeviceSelector::default();
        if let Ok(d) = std::env::var("OBJECTCACHE_RDMA_DEVICE") {
            if !d.is_empty() {
                s.device = Some(d);
            }
        }
        let num = |var: &str| -> Result<Option<u8>> {
            match std::env::var(var) {
                Ok(v) if !v.is_empty() => v.parse::<u8>().map(Some).map_err(|_| {
                    RdmaError::InvalidArgument(format!("{var}={v:?} is not a number in 0..=255"))
                }),
                _ => Ok(None),
            }
        };
        if let Some(p) = num("OBJECTCACHE_RDMA_PORT")? {
            s.port = p;
        }
        s.gid_index = num("OBJECTCACHE_RDMA_GID_INDEX")?;
        Ok(s)
    }
}

/// Names of the RDMA devices this host exposes (`ibv_get_device_list`).
///
/// # Errors
/// [`RdmaError::NoDevice`] when the kernel has no RDMA support (the call fails with `ENOSYS`)
/// or lists no device.
pub fn devices() -> Result<Vec<String>> {
    let mut n: i32 = 0;
    // SAFETY: `ibv_get_device_list` writes the count into `n` and returns a NULL-terminated
    // array owned by libibverbs (or NULL with errno set); we only read it before freeing it.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(RdmaError::NoDevice(format!(
            "the kernel offers no RDMA (ibv_get_device_list: {e}); load a driver such as rdma_rxe or use TCP"
        )));
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: `i < n`, so `list.add(i)` is inside the array; each entry is a valid
        // `ibv_device` whose name is a NUL-terminated string living as long as the list.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from `ibv_get_device_list` and is freed exactly once.
    unsafe { ffi::ibv_free_device_list(list) };
    if names.is_empty() {
        return Err(RdmaError::NoDevice(
            "no RDMA device is present (ibv_devices lists none)".into(),
        ));
    }
    Ok(names)
}

/// Which transport a client should use, with the reason when it is TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportChoice {
    /// RDMA on this device.
    Rdma {
        /// Device name.
        device: String,
    },
    /// The TCP gather path, because RDMA is unavailable.
    Tcp {
        /// Why RDMA was not chosen (e.g. "no RDMA device: ...").
        reason: String,
    },
}

/// Chooses RDMA when the selected device exists and opens with an active port, else TCP
/// with the reason. Never fails: every RDMA problem becomes [`TransportChoice::Tcp`].
pub fn select_transport(sel: &DeviceSelector) -> TransportChoice {
    match Context::open(sel) {
        Ok(ctx) => TransportChoice::Rdma {
            device: ctx.name().to_string(),
        },
        Err(e) => TransportChoice::Tcp {
            reason: e.to_string(),
        },
    }
}

/// An opened device (`ibv_context`) with the port and GID this end uses.
///
/// Shapes: `gid` is 16 bytes (for RoCE v2 over IPv4, `::ffff:a.b.c.d`); `lid` is 0 on RoCE.
#[derive(Debug)]
pub struct Context {
    raw: NonNull<ffi::ibv_context>,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    active_mtu: u32,
    max_mr_size: u64,
}

// SAFETY: libibverbs documents all verbs on a context as thread-safe; the struct holds only
// the context pointer and plain data read once at open.
unsafe impl Send for Context {}
// SAFETY: as above; no method mutates through `&self` other than via thread-safe verbs.
unsafe impl Sync for Context {}

/// `ibv_mtu` enum value → bytes.
fn mtu_bytes(m: u32) -> u32 {
    match m {
        ffi::ibv_mtu::IBV_MTU_256 => 256,
        ffi::ibv_mtu::IBV_MTU_512 => 512,
        ffi::ibv_mtu::IBV_MTU_1024 => 1024,
        ffi::ibv_mtu::IBV_MTU_2048 => 2048,
        ffi::ibv_mtu::IBV_MTU_4096 => 4096,
        _ => 1024,
    }
}

/// Bytes → `ibv_mtu` enum value (rounded down to a valid MTU, at least 256).
pub(crate) fn mtu_enum(bytes: u32) -> u32 {
    match bytes {
        b if b >= 4096 => ffi::ibv_mtu::IBV_MTU_4096,
        b if b >= 2048 => ffi::ibv_mtu::IBV_MTU_2048,
        b if b >= 1024 => ffi::ibv_mtu::IBV_MTU_1024,
        b if b >= 512 => ffi::ibv_mtu::IBV_MTU_512,
        _ => ffi::ibv_mtu::IBV_MTU_256,
    }
}

impl Context {
    /// Opens the selected device, queries the port (it must be ACTIVE) and picks the GID.
    ///
    /// # Errors
    /// [`RdmaError::NoDevice`] when the device is missing, [`RdmaError::Verbs`] when opening or
    /// querying fails, [`RdmaError::InvalidArgument`] when the port is not active or the GID
    /// index is empty.
    pub fn open(sel: &DeviceSelector) -> Result<Arc<Context>> {
        let names = devices()?;
        let want = match &sel.device {
            Some(d) => {
                if !names.iter().any(|n| n == d) {
                    return Err(RdmaError::NoDevice(format!(
                        "device {d:?} is not present (devices: {})",
                        names.join(", ")
                    )));
                }
                d.clone()
            }
            None => names[0].clone(),
        };
        let mut n: i32 = 0;
        // SAFETY: see `devices`; the list is freed below after the device is opened (an opened
        // context stays valid after the list is freed, as libibverbs documents).
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(RdmaError::verbs("ibv_get_device_list", 0));
        }
        let mut ctx: *mut ffi::ibv_context = std::ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: `i < n`; entries and their names are valid while the list lives.
            let dev = unsafe { *list.add(i) };
            // SAFETY: as above.
            let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
            if name.to_string_lossy() == want {
                // SAFETY: `dev` is a valid device from the live list.
                ctx = unsafe { ffi::ibv_open_device(dev) };
                break;
            }
        }
        let open_err = if ctx.is_null() {
            Some(RdmaError::verbs("ibv_open_device", 0))
        } else {
            None
        };
        // SAFETY: `list` came from `ibv_get_device_list` and is freed exactly once.
        unsafe { ffi::ibv_free_device_list(list) };
        if let Some(e) = open_err {
            return Err(e);
        }
        let raw = NonNull::new(ctx).ok_or_else(|| RdmaError::verbs("ibv_open_device", 0))?;
        // From here on `Drop` closes the device on every early return.
        let mut me = Context {
            raw,
            name: want,
            port: sel.port,
            gid_index: 0,
            gid: [0; 16],
            lid: 0,
            active_mtu: 1024,
            max_mr_size: 0,
        };

        // SAFETY: all-zero is a valid bit pattern for this plain C struct.
        let mut pa: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is an open context and `pa` a writable port attribute struct of the
        // size the provider expects (the helper passes `sizeof`).
        let rc = unsafe { ffi::___ibv_query_port(me.raw.as_ptr(), sel.port, &mut pa) };
        if rc != 0 {
            return Err(RdmaError::verbs("ibv_query_port", rc));
        }
        if pa.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(RdmaError::InvalidArgument(format!(
                "port {} of {} is not ACTIVE (state {}): check the link",
                sel.port, me.name, pa.state
            )));
        }
        me.lid = pa.lid;
        me.active_mtu = mtu_bytes(pa.active_mtu);

        // SAFETY: zeroed is valid for this plain struct; `ibv_query_device` fills it.
        let mut da: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is open; `da` is writable.
        let rc = unsafe { ffi::ibv_query_device(me.raw.as_ptr(), &mut da) };
        if rc != 0 {
            return Err(RdmaError::verbs("ibv_query_device", rc));
        }
        me.max_mr_size = da.max_mr_size;

        let idx = match sel.gid_index {
            Some(i) => i,
            None => me.auto_gid_index(pa.gid_tbl_len.clamp(0, 256) as u16),
        };
        let gid = me.query_gid(idx)?;
        if gid == [0; 16] {
            return Err(RdmaError::InvalidArgument(format!(
                "GID index {idx} of {} port {} is empty; set OBJECTCACHE_RDMA_GID_INDEX (see `show_gids`)",
                me.name, sel.port
            )));
        }
        me.gid_index = idx;
        me.gid = gid;
        Ok(Arc::new(me))
    }

    fn query_gid(&self, idx: u8) -> Result<[u8; 16]> {
        // SAFETY: `ibv_gid` is a 16-byte union; zeroed is valid.
        let mut g: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `g` is writable.
        let rc = unsafe { ffi::ibv_query_gid(self.raw.as_ptr(), self.port, idx as i32, &mut g) };
        if rc != 0 {
            return Err(RdmaError::verbs("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(unsafe { g.raw })
    }

    /// First RoCE v2 GID holding an IPv4-mapped address, else first RoCE v2, else first
    /// non-zero GID, else 0. The GID type comes from sysfs (`gid_attrs/types/N`).
    fn auto_gid_index(&self, table_len: u16) -> u8 {
        let mut first_v2 = None;
        let mut first_nonzero = None;
        for i in 0..table_len.min(256) {
            let i = i as u8;
            let Ok(g) = self.query_gid(i) else { continue };
            if g == [0; 16] {
                continue;
            }
            first_nonzero.get_or_insert(i);
            let ty = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{}/ports/{}/gid_attrs/types/{}",
                self.name, self.port, i
            ))
            .unwrap_or_default();
            if ty.trim().eq_ignore_ascii_case("RoCE v2") {
                first_v2.get_or_insert(i);
                if g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff {
                    return i;
                }
            }
            if i == u8::MAX {
                break;
            }
        }
        first_v2.or(first_nonzero).unwrap_or(0)
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.raw.as_ptr()
    }
    /// Device name (`rxe0`, `mlx5_0`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Port number in use (1-based).
    pub fn port(&self) -> u8 {
        self.port
    }
    /// GID table index in use.
    pub fn gid_index(&self) -> u8 {
        self.gid_index
    }
    /// The 16-byte GID in use.
    pub fn gid(&self) -> [u8; 16] {
        self.gid
    }
    /// The port's LID (0 on RoCE).
    pub fn lid(&self) -> u16 {
        self.lid
    }
    /// The port's active path MTU in bytes (256..=4096).
    pub fn active_mtu(&self) -> u32 {
        self.active_mtu
    }
    /// Largest memory region the device can register, in bytes.
    pub fn max_mr_size(&self) -> u64 {
        self.max_mr_size
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context was opened by `ibv_open_device`; every PD/CQ/QP holds an `Arc`
        // to it, so this runs after they are destroyed.
        unsafe { ffi::ibv_close_device(self.raw.as_ptr()) };
    }
}
