//! Load admission: which waiting load is served next when a slot frees. Policies implement
//! [`LoadScheduler`]; [`FifoAdmission`] and [`PriorityAdmission`] are built in.

use objectcache_client::sched::{PolicyKind, SchedulerSetting};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// A load waiting for admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// Server-wide load id.
    pub id: u64,
    /// Arrival sequence number (monotonic).
    pub seq: u64,
    /// Descriptor priority, higher first.
    pub priority: u8,
    /// Deadline of the first requested layer, microseconds after arrival, if hinted.
    pub first_deadline_us: Option<u64>,
    /// Payload bytes the load will send.
    pub bytes: u64,
}

/// A policy ordering waiting loads. Called under a lock; must not block.
pub trait LoadScheduler: Send + std::fmt::Debug {
    /// Short name (`fifo`, `priority`).
    fn name(&self) -> &'static str;
    /// Adds a waiting load.
    fn push(&mut self, t: Ticket);
    /// The load to admit next.
    fn pop(&mut self) -> Option<Ticket>;
    /// Loads waiting.
    fn len(&self) -> usize;
    /// `true` if none waits.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Arrival order.
#[derive(Debug, Default)]
pub struct FifoAdmission(VecDeque<Ticket>);

impl LoadScheduler for FifoAdmission {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn push(&mut self, t: Ticket) {
        self.0.push_back(t);
    }
    fn pop(&mut self) -> Option<Ticket> {
        self.0.pop_front()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PrioKey(u8, Reverse<u64>, Reverse<u64>);

/// Highest priority first; then the earliest absolute first-layer deadline (arrival
/// sequence used as the time base); then arrival.
#[derive(Debug, Default)]
pub struct PriorityAdmission(BinaryHeap<(PrioKey, TicketBox)>);

#[derive(Debug)]
struct TicketBox(Ticket);
impl PartialEq for TicketBox {
    fn eq(&self, o: &Self) -> bool {
        self.0.id == o.0.id
    }
}
impl Eq for TicketBox {}
impl PartialOrd for TicketBox {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for TicketBox {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.0.id.cmp(&self.0.id)
    }
}

impl LoadScheduler for PriorityAdmission {
    fn name(&self) -> &'static str {
        "priority"
    }
    fn push(&mut self, t: Ticket) {
        let k = PrioKey(
            t.priority,
            Reverse(t.first_deadline_us.unwrap_or(u64::MAX)),
            Reverse(t.seq),
        );
        self.0.push((k, TicketBox(t)));
    }
    fn pop(&mut self) -> Option<Ticket> {
        self.0.pop().map(|(_, t)| t.0)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// The admission policy of the `scheduler` setting `name`
/// ([`SchedulerSetting`]): [`PriorityAdmission`] for `priority`, [`FifoAdmission`] for the others;
/// `None` for an unknown name.
pub fn by_name(name: &str) -> Option<Box<dyn LoadScheduler>> {
    SchedulerSetting::parse(name).ok().map(admission)
}

/// The admission policy of a parsed `scheduler` setting: [`PriorityAdmission`] or [`FifoAdmission`].
pub fn admission(s: SchedulerSetting) -> Box<dyn LoadScheduler> {
    if s.priority_admission {
        Box::<PriorityAdmission>::default()
    } else {
        Box::<FifoAdmission>::default()
    }
}

/// The bandwidth-sharing policy of the `scheduler` setting `name` (used under a bandwidth
/// cap; [`SchedulerSetting`]); `None` for an unknown name.
pub fn link_policy(name: &str) -> Option<PolicyKind> {
    SchedulerSetting::parse(name).ok().map(|s| s.policy)
}

#[cfg(test)]
mod tests {
    use super::*;
    fn t(id: u64, priority: u8) -> Ticket {
        Ticket {
            id,
            seq: id,
            priority,
            first_deadline_us: None,
            bytes: 0,
        }
    }
    #[test]
    fn fifo_and_priority_order() {
        let mut f = FifoAdmission::default();
        let mut p = PriorityAdmission::default();
        for (id, pr) in [(1, 1), (2, 9), (3, 9), (4, 5)] {
            f.push(t(id, pr));
            p.push(t(id, pr));
        }
        let fo: Vec<_> = std::iter::from_fn(|| f.pop()).map(|t| t.id).collect();
        let po: Vec<_> = std::iter::from_fn(|| p.pop()).map(|t| t.id).collect();
        assert_eq!(fo, [1, 2, 3, 4]);
        assert_eq!(po, [2, 3, 4, 1]);
    }
    #[test]
    fn scheduler_names() {
        use PolicyKind as K;
        for (n, adm, k) in [
            ("fifo", "fifo", K::Fifo),
            ("priority", "priority", K::Fifo),
            ("equal", "fifo", K::EqualShare),
            ("byte-prop", "fifo", K::ByteProportional),
            ("stall-aware", "fifo", K::StallAware),
        ] {
            assert_eq!(by_name(n).unwrap().name(), adm);
            assert_eq!(link_policy(n), Some(k));
        }
        assert!(by_name("lottery").is_none() && link_policy("lottery").is_none());
    }
}
