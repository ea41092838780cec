//! Handles: opaque tokens for engines, memory regions and transfers, looked up in one
//! registry (never dereferenced), and the objects behind them.

use super::*;

pub(super) struct EngineObj {
    pub(super) engine: Engine,
    pub(super) live_transfers: AtomicUsize,
    /// Tokens of the regions registered with this engine.
    pub(super) regions: Mutex<Vec<usize>>,
}

/// A region handle: the engine it was registered with (its token) and the engine's id of it.
pub(super) struct RegionObj {
    pub(super) engine: usize,
    pub(super) id: RegionId,
}

/// One transfer's hold on its engine: while it lives, destroying the engine is refused.
/// (The regions a transfer writes into are held by its [`RegisteredLoad`].)
pub(super) struct Busy {
    pub(super) engine: Arc<EngineObj>,
}

impl Busy {
    pub(super) fn new(engine: Arc<EngineObj>) -> Busy {
        engine.live_transfers.fetch_add(1, Ordering::AcqRel);
        Busy { engine }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.engine.live_transfers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Raised when a transfer has been dropped whole: its last field, so it drops after the
/// others (Rust drops fields in declaration order). `objectcache_transfer_release` waits for
/// it, whichever thread lets go of the transfer last.
pub(super) struct Released(pub(super) Arc<(Mutex<bool>, Condvar)>);

impl Drop for Released {
    fn drop(&mut self) {
        let (done, cv) = &*self.0;
        *lock(done) = true;
        cv.notify_all();
    }
}

/// A load started through the C ABI. Its fields drop in this order, which is the order
/// release needs: the load (dropping it waits for its device copies, stops every task of
/// the load and waits until none can touch the destinations, then lets the regions go),
/// then the hold on the engine, and last the signal that the transfer is gone.
pub(super) struct TransferObj {
    pub(super) load: RegisteredLoad,
    /// Held for its drop.
    pub(super) _busy: Busy,
    pub(super) request_id: u64,
    pub(super) released: Released,
}

pub(super) enum Obj {
    Engine(Arc<EngineObj>),
    Region(Arc<RegionObj>),
    Transfer(Arc<TransferObj>),
}

impl Obj {
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Obj::Engine(_) => "an engine",
            Obj::Region(_) => "a memory region",
            Obj::Transfer(_) => "a transfer",
        }
    }
}

static REGISTRY: LazyLock<Mutex<HashMap<usize, Obj>>> = LazyLock::new(Default::default);
/// Next handle token; tokens are never reused, so a stale handle is always detected.
static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(0x10);

pub(super) fn registry() -> MutexGuard<'static, HashMap<usize, Obj>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn insert(o: Obj) -> usize {
    let id = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
    registry().insert(id, o);
    id
}

pub(super) fn token<T>(id: usize) -> *mut T {
    std::ptr::without_provenance_mut(id)
}

pub(super) fn lookup_obj<T>(p: *mut T, want: &'static str) -> Result<(usize, Obj), CErr> {
    let id = p.addr();
    if id == 0 {
        return Err(err(
            OBJECTCACHE_ERR_INVALID_HANDLE,
            format!("{want} handle is NULL"),
        ));
    }
    let reg = registry();
    let o = reg.get(&id).ok_or_else(|| {
        err(
            OBJECTCACHE_ERR_INVALID_HANDLE,
            format!(
                "{want} handle {id:#x} is not live (already released or destroyed, or never \
                 created)"
            ),
        )
    })?;
    let o = match o {
        Obj::Engine(e) => Obj::Engine(e.clone()),
        Obj::Region(r) => Obj::Region(r.clone()),
        Obj::Transfer(t) => Obj::Transfer(t.clone()),
    };
    Ok((id, o))
}

pub(super) fn wrong_kind(id: usize, o: &Obj, want: &str) -> CErr {
    err(
        OBJECTCACHE_ERR_INVALID_HANDLE,
        format!("handle {id:#x} is {}, not {want}", o.kind()),
    )
}

pub(super) fn get_engine(p: *mut objectcache_engine) -> Result<Arc<EngineObj>, CErr> {
    match lookup_obj(p, "engine")? {
        (_, Obj::Engine(e)) => Ok(e),
        (id, o) => Err(wrong_kind(id, &o, "an engine")),
    }
}

pub(super) fn get_transfer(p: *mut objectcache_transfer) -> Result<Arc<TransferObj>, CErr> {
    match lookup_obj(p, "transfer")? {
        (_, Obj::Transfer(t)) => Ok(t),
        (id, o) => Err(wrong_kind(id, &o, "a transfer")),
    }
}
