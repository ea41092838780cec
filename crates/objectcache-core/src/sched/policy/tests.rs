//! Tests of the bandwidth policies: water filling, the baselines, and stall-aware sharing
//! against its exhaustive reference.

use super::super::scheduler::{LoadSpec, Scheduler};
use super::*;

fn spec(layers: usize, bytes: u64, c: f64, max_rate: f64) -> LoadSpec {
    LoadSpec {
        layer_bytes: vec![bytes; layers],
        layer_compute_s: vec![c; layers],
        compute_ready_s: 0.0,
        max_rate,
    }
}

fn rates(kind: PolicyKind, specs: Vec<LoadSpec>, cap: f64) -> Vec<f64> {
    let mut s = Scheduler::new(kind.build(), cap, cap, 0.0).unwrap();
    for sp in specs {
        s.handle_arrival(0.0, sp).unwrap();
    }
    s.poll_allocation(0.0).iter().map(|a| a.rate).collect()
}

#[test]
fn water_fill_respects_caps_and_weights() {
    let mut r = vec![0.0; 3];
    water_fill(10.0, &[1.0, 1.0, 1.0], &[1.0, 100.0, 100.0], &mut r);
    assert_eq!(r, vec![1.0, 4.5, 4.5]);
    let mut r = vec![0.0; 2];
    water_fill(9.0, &[1.0, 2.0], &[100.0, 100.0], &mut r);
    assert_eq!(r, vec![3.0, 6.0]);
}

#[test]
fn baseline_policies() {
    let inf = f64::INFINITY;
    let sp = || vec![spec(2, 100, 1.0, inf), spec(2, 300, 1.0, 30.0)];
    assert_eq!(rates(PolicyKind::Fifo, sp(), 100.0), vec![100.0, 0.0]);
    assert_eq!(rates(PolicyKind::EqualShare, sp(), 100.0), vec![70.0, 30.0]);
    assert_eq!(
        rates(
            PolicyKind::ByteProportional,
            vec![spec(2, 100, 1.0, inf), spec(2, 300, 1.0, inf)],
            100.0
        ),
        vec![25.0, 75.0]
    );
    assert_eq!(
        PolicyKind::parse("stall-aware").unwrap(),
        PolicyKind::StallAware
    );
    assert!(PolicyKind::parse("lottery").is_err());
    for (n, prio, k) in [
        ("fifo", false, PolicyKind::Fifo),
        ("priority", true, PolicyKind::Fifo),
        ("equal", false, PolicyKind::EqualShare),
        ("equal-share", false, PolicyKind::EqualShare),
        ("byte-prop", false, PolicyKind::ByteProportional),
        ("byte-proportional", false, PolicyKind::ByteProportional),
        ("stall-aware", false, PolicyKind::StallAware),
    ] {
        let s = SchedulerSetting::parse(n).unwrap();
        assert_eq!((s.priority_admission, s.policy), (prio, k), "{n}");
    }
    let e = SchedulerSetting::parse("lottery").unwrap_err().to_string();
    assert!(
        e.contains("\"lottery\"") && e.contains(SchedulerSetting::NAMES),
        "{e}"
    );
}

#[test]
fn stall_aware_gives_hidden_loads_only_what_they_need() {
    // Load 0 has its first layer delivered and is hideable at 10 B/s; load 1 is stalling.
    let mut s = Scheduler::new(PolicyKind::StallAware.build(), 100.0, 100.0, 0.0).unwrap();
    let a = s
        .handle_arrival(0.0, spec(3, 10, 1.0, f64::INFINITY))
        .unwrap();
    let b = s
        .handle_arrival(0.0, spec(3, 100, 0.1, f64::INFINITY))
        .unwrap();
    s.handle_progress(0.0, a, 10).unwrap();
    let al = s.poll_allocation(0.0).to_vec();
    assert_eq!(al[0].id, a);
    assert!((al[0].rate - 10.0).abs() < 1e-9, "{al:?}");
    assert!((al[1].rate - 90.0).abs() < 1e-9 && al[1].id == b);
}

#[test]
fn stall_aware_bounds_rank_as_the_exhaustive_policy() {
    // Two schedulers fed the same events, one with the lazy ranking from remembered
    // stall bounds, one ranking every load afresh at every re-plan (the definition):
    // their allocations must be equal to the bit at every step. Demand is about 1.5
    // times the link, so a queue of stalling loads builds up behind hideable ones;
    // capacity changes, compute reports, cancellations and idle steps (no re-plan
    // between polls) are mixed in.
    let mut fast = Scheduler::new(PolicyKind::StallAware.build(), 12e3, 12e3, 0.0).unwrap();
    let mut slow = Scheduler::new(Box::new(StallAware::exhaustive()), 12e3, 12e3, 0.0).unwrap();
    let mut x = 0x5eed_u64;
    let mut rnd = |n: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    let mut now = 0.0;
    let (mut most, mut partial) = (0, 0);
    for step in 0..4000 {
        if rnd(3) == 0 {
            let layers = 1 + rnd(8) as usize;
            let sp = LoadSpec {
                layer_bytes: (0..layers).map(|_| 10 + rnd(200)).collect(),
                layer_compute_s: (0..layers).map(|_| rnd(50) as f64 / 1e3).collect(),
                compute_ready_s: now + rnd(3) as f64 * 0.01,
                max_rate: if rnd(4) == 0 { 3e3 } else { f64::INFINITY },
            };
            let a = fast.handle_arrival(now, sp.clone()).unwrap();
            assert_eq!(a, slow.handle_arrival(now, sp).unwrap());
        }
        if rnd(100) == 0 {
            let c = 8e3 + rnd(8000) as f64;
            fast.set_capacity(now, c).unwrap();
            slow.set_capacity(now, c).unwrap();
        }
        let al = fast.poll_allocation(now).to_vec();
        assert_eq!(al, slow.poll_allocation(now), "step {step} at {now} s");
        most = most.max(al.len());
        if al.iter().any(|a| a.rate > 0.0) && al.iter().any(|a| a.rate == 0.0) {
            partial += 1;
        }
        let dt = rnd(20) as f64 / 1e3 + 1e-4;
        now += dt;
        for a in &al {
            let l = fast.load(a.id).unwrap();
            let bytes = ((a.rate * dt) as u64).min(l.remaining_bytes());
            if bytes > 0 {
                fast.handle_progress(now, a.id, bytes).unwrap();
                slow.handle_progress(now, a.id, bytes).unwrap();
            }
            let l = fast.load(a.id).unwrap();
            if l.remaining_bytes() == 0 || rnd(400) == 0 {
                fast.handle_departure(now, a.id).unwrap();
                slow.handle_departure(now, a.id).unwrap();
            } else if l.layers_delivered() > 0 && rnd(30) == 0 {
                let layer = l.layers_delivered() - 1;
                fast.handle_layer_computed(now, a.id, layer).unwrap();
                slow.handle_layer_computed(now, a.id, layer).unwrap();
            }
        }
        if rnd(4) != 0 {
            fast.handle_timeout(now);
            slow.handle_timeout(now);
        }
    }
    assert!(most > 40, "a queue builds up: at most {most} loads");
    assert!(partial > 1000, "{partial} allocations leave loads waiting");
}

#[test]
fn stall_aware_serves_shortest_stall_first_and_wastes_nothing() {
    // Two transfer-bound loads: the smaller one goes first with the whole link.
    let r = rates(
        PolicyKind::StallAware,
        vec![
            spec(4, 400, 0.01, f64::INFINITY),
            spec(4, 100, 0.01, f64::INFINITY),
        ],
        100.0,
    );
    assert_eq!(r, vec![0.0, 100.0]);
    // With a per-load limit the rest goes to the next load.
    let r = rates(
        PolicyKind::StallAware,
        vec![spec(4, 400, 0.01, f64::INFINITY), spec(4, 100, 0.01, 60.0)],
        100.0,
    );
    assert_eq!(r, vec![40.0, 60.0]);
    // Every policy uses the whole link while some load can take it.
    for k in PolicyKind::ALL {
        let r = rates(
            k,
            vec![spec(4, 400, 0.01, 70.0), spec(4, 100, 10.0, 70.0)],
            100.0,
        );
        assert!((r.iter().sum::<f64>() - 100.0).abs() < 1e-9, "{k:?} {r:?}");
    }
}
