//! Tests of the compute model: the reference points it reproduces, the weight-read floor,
//! measured mode, and the parsing of model settings.

use super::*;

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

fn m(model: &str, gpu: GpuKind, k: KernelClass) -> ComputeModel {
    ComputeModel::preset(model, gpu, k).unwrap()
}

#[test]
fn p_layer_matches_llama3_table() {
    let s8 = ModelShape::preset("llama-3.1-8b").unwrap();
    assert!(
        close(s8.linear_params_per_layer as f64, 218.1e6, 0.001),
        "{}",
        s8.linear_params_per_layer
    );
    assert_eq!(s8.kv_bytes_per_token_per_layer, 4096);
    let s70 = ModelShape::preset("llama-3.1-70b").unwrap();
    assert!(close(s70.linear_params_per_layer as f64, 855.6e6, 0.001));
    assert_eq!(s70.kv_bytes_per_token_per_layer, 4096);
    // KV bytes agree with the layout presets.
    for name in [
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "smollm2-135m",
    ] {
        let g = crate::layout::KvGeometry::preset(name).unwrap();
        let s = ModelShape::preset(name).unwrap();
        assert_eq!(
            s.kv_bytes_per_token_per_layer,
            g.bytes_per_token_per_layer(),
            "{name}"
        );
        assert_eq!(s.layers, g.layers, "{name}");
    }
}

#[test]
fn reproduces_reference_table_8b() {
    // Predicted batch-1 prefill from scratch, Llama-3.1-8B, one GPU, BF16 (compute.md §7).
    let rows: &[(GpuKind, KernelClass, [f64; 7])] = &[
        (
            GpuKind::A100,
            KernelClass::Tuned,
            [0.078, 0.33, 0.72, 1.66, 4.2, 12.0, 38.1],
        ),
        (
            GpuKind::H100,
            KernelClass::Fa2,
            [0.023, 0.10, 0.23, 0.57, 1.55, 4.8, 16.2],
        ),
        (
            GpuKind::H100,
            KernelClass::Tuned,
            [0.023, 0.096, 0.21, 0.47, 1.19, 3.3, 10.4],
        ),
        (
            GpuKind::H200,
            KernelClass::Tuned,
            [0.023, 0.096, 0.21, 0.47, 1.19, 3.3, 10.4],
        ),
    ];
    let lens = [1024u64, 4096, 8192, 16384, 32768, 65536, 131072];
    for (gpu, k, want) in rows {
        let cm = m("llama-3.1-8b", *gpu, *k);
        for (n, w) in lens.iter().zip(want) {
            let got = cm.compute_time(*n, 0);
            assert!(
                close(got, *w, 0.06),
                "{gpu:?} {k:?} {n}: got {got:.4} want {w}"
            );
        }
    }
}

#[test]
fn reproduces_reference_points() {
    let h100 = m("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned);
    assert!(close(h100.compute_time(4096, 0), 0.096, 0.02));
    assert!(close(h100.compute_time(65536, 0), 3.3, 0.03));
    // "one H100 prefills about 20K tokens of Llama-3.1-8B in about 0.75 s" (FA2-class).
    let fa2 = m("llama-3.1-8b", GpuKind::H100, KernelClass::Fa2);
    assert!(
        close(fa2.prefill_time(20_000, 0), 0.75, 0.03),
        "{}",
        fa2.prefill_time(20_000, 0)
    );
    // A100 HF+FA2 fit: MInference 10K -> 0.976 s published, 0.986 s predicted.
    let a = m("llama-3.1-8b", GpuKind::A100, KernelClass::Fa2);
    assert!(
        close(a.compute_time(10_000, 0), 0.986, 0.02),
        "{}",
        a.compute_time(10_000, 0)
    );
    // Per-layer example of compute.md §7: 512 new over 16K prefix in 0.58 ms on H100.
    assert!(
        close(h100.layer_time(0, 512, 16384), 0.58e-3, 0.03),
        "{}",
        h100.layer_time(0, 512, 16384)
    );
    // 70B TP8 FA3-class 4K: 0.11 s.
    let t8 = AnalyticModel::new(
        ModelShape::preset("70b").unwrap(),
        GpuKind::H100,
        KernelClass::Tuned,
        8,
    )
    .unwrap();
    let t = ComputeModel::Analytic(t8).compute_time(4096, 0);
    assert!(close(t, 0.11, 0.06), "{t}");
}

#[test]
fn weight_read_floor_binds_for_few_tokens() {
    // compute.md §7: 128 new tokens over 4K: weight floor 0.13 ms on H100, 0.09 ms on H200.
    let h100 = m("llama-3.1-8b", GpuKind::H100, KernelClass::Tuned);
    let h200 = m("llama-3.1-8b", GpuKind::H200, KernelClass::Tuned);
    assert!(close(h100.layer_time(0, 128, 4096), 0.13e-3, 0.05));
    // On H200 compute (0.10 ms) exceeds the 0.09 ms floor at 128 tokens; at 64 the floor binds.
    assert!(close(h200.layer_time(0, 64, 0), 0.09e-3, 0.05));
    assert!(h200.layer_time(0, 128, 4096) < h100.layer_time(0, 128, 4096));
}

#[test]
fn measured_mode_scales_by_ratio() {
    let a = AnalyticModel::new(
        ModelShape::preset("8b").unwrap(),
        GpuKind::H100,
        KernelClass::Tuned,
        1,
    )
    .unwrap();
    let per = vec![0.002; 32];
    let mm = ComputeModel::Measured(MeasuredModel::new(per, 0.004, 4096, 0, a.clone()).unwrap());
    assert!(close(mm.layer_time(3, 4096, 0), 0.002, 1e-12));
    let ratio = a.layer_time(8192, 0) / a.layer_time(4096, 0);
    assert!(close(mm.layer_time(3, 8192, 0), 0.002 * ratio, 1e-12));
    assert!(close(mm.prefill_time(4096, 0), 0.068, 1e-9));
    assert!(MeasuredModel::new(vec![0.1; 3], 0.0, 1, 0, a.clone()).is_err());
    assert!(MeasuredModel::new(vec![f64::NAN; 32], 0.0, 1, 0, a).is_err());
}

#[test]
fn settings_name_an_analytic_or_a_measured_model() {
    let a = ComputeModel::from_settings("8b", "h100", "tuned", 1, 0, 4096, 128).unwrap();
    assert_eq!(
        a,
        ComputeModel::preset("8b", GpuKind::H100, KernelClass::Tuned).unwrap()
    );
    // 2,000 us per layer, measured for 128 new tokens after 4,096 cached.
    let m = ComputeModel::from_settings("8b", "h200", "tuned", 1, 2000, 4096, 128).unwrap();
    assert!(matches!(m, ComputeModel::Measured(_)));
    assert_eq!(m.layers(), 32);
    assert!(close(m.layer_time(31, 128, 4096), 0.002, 1e-12));
    let bad = |r: Result<ComputeModel, Error>| r.unwrap_err().to_string();
    assert!(bad(ComputeModel::from_settings(
        "8b", "h100", "tuned", 1, 2000, 4096, 0
    ))
    .contains("new_tokens"));
    assert!(bad(ComputeModel::from_settings(
        "8b",
        "h100",
        "tuned",
        1,
        1 << 40,
        4096,
        1
    ))
    .contains("is above"));
    assert!(bad(ComputeModel::from_settings(
        "8b", "v100", "tuned", 1, 0, 0, 1
    ))
    .contains("v100"));
}

#[test]
fn parse_errors_name_the_input() {
    let e = GpuKind::parse("v100").unwrap_err().to_string();
    assert!(e.contains("v100") && e.contains("h100"), "{e}");
    assert!(ModelShape::preset("gpt-9")
        .unwrap_err()
        .to_string()
        .contains("gpt-9"));
    assert_eq!(GpuKind::parse("H200").unwrap(), GpuKind::H200);
}
