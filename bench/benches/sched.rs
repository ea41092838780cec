//! Decision cost of the scheduler per event at 1,000 concurrent loads (issue 4: "well under a
//! millisecond"). Each iteration is one event followed by the re-plan it triggers.
//!
//! Run: `cargo bench -p objectcache-bench --bench sched`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use objectcache::sched::{ComputeModel, GpuKind, KernelClass, LoadSpec, PolicyKind, Scheduler};

const LOADS: usize = 1000;

/// 1,000 Llama-3.1-8B loads of 4K-128K-token prefixes (deterministic), some partly delivered.
fn scheduler(kind: PolicyKind) -> Scheduler {
    let model = ComputeModel::preset("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned).unwrap();
    let prefixes = [4096u64, 8192, 16384, 32768, 65536, 131072];
    let mut s = Scheduler::new(kind.build(), 0.5 * 12.5e9, 4e6, 0.0).unwrap();
    for i in 0..LOADS {
        let prefix = prefixes[i % prefixes.len()];
        let spec = LoadSpec {
            layer_bytes: vec![prefix * 4096; model.layers()],
            layer_compute_s: model.layer_times(512, prefix),
            compute_ready_s: i as f64 * 1e-3,
            max_rate: f64::INFINITY,
        };
        let id = s.handle_arrival(0.0, spec).unwrap();
        if i % 3 == 0 {
            s.handle_progress(0.0, id, (i as u64 % 7) * prefix * 4096)
                .unwrap();
        }
    }
    s.replan(0.0);
    s
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("sched_1000_loads");
    for kind in PolicyKind::ALL {
        let mut s = scheduler(kind);
        let mut now = 0.5;
        g.bench_function(format!("replan/{}", kind.name()), |b| {
            b.iter(|| {
                now += 1e-9;
                s.handle_timeout(now);
                black_box(s.poll_allocation(now).len())
            })
        });
    }
    let mut s = scheduler(PolicyKind::StallAware);
    let mut now = 0.5;
    g.bench_function("next_unit/stall-aware", |b| {
        b.iter(|| {
            now += 1e-3;
            match s.poll_next_unit(now, 1 << 20) {
                Some(u) => {
                    s.handle_progress(now, u.id, u.bytes).unwrap();
                    if s.load(u.id).unwrap().remaining_bytes() == 0 {
                        s.handle_departure(now, u.id).unwrap();
                    }
                    black_box(u.bytes)
                }
                None => 0,
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
