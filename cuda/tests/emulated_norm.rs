#[test]
fn rms_norm_rows_matches_the_cpu_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    for dim in [1usize, 7, 16, 64, 100, 1024] {
        let rows = 3;
        let x: Vec<f32> = (0..rows * dim).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let w: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 / 13.0).collect();
        let mut expect = x.clone();
        for r in expect.chunks_exact_mut(dim) {
            deepinfer_kernels::ops::rms_norm(r, Some(&w), 1e-6);
        }
        let xd = gpu.upload(&x).unwrap();
        let wd = gpu.upload(&w).unwrap();
        gpu.launch(
            "rms_norm_rows",
            (rows as u32, 1, 1),
            (128, 1, 1),
            0,
            &[xd.arg(), wd.arg(), (dim as i32).into(), 1e-6f32.into()],
        )
        .unwrap();
        let got = gpu.download(&xd).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            expect.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "dim {dim}"
        );
    }
}
