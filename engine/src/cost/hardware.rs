//! Accelerator figures from vendors' published datasheets (dense, no sparsity),
//! per device. Where a part has no native format, the next wider one is used.

/// A known accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HardwareKind {
    H800,
    H100,
    H200,
    B200,
    Gb200,
    Gb300,
    Ascend950,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Hardware {
    pub kind: HardwareKind,
    pub name: &'static str,
    pub bf16_tflops: f64,
    pub fp8_tflops: f64,
    /// `None`: no FP4 tensor cores (FP4 weights run at FP8 rate).
    pub fp4_tflops: Option<f64>,
    pub hbm_gib: f64,
    pub hbm_tb_s: f64,
    /// Per-device bandwidth inside the scale-up domain (NVLink / HCCS), one direction.
    pub scale_up_gb_s: f64,
    /// Per-device bandwidth to other nodes (InfiniBand / RoCE), one direction.
    pub scale_out_gb_s: f64,
    /// Devices in one scale-up domain.
    pub scale_up_domain: usize,
    /// Host memory a device can hold offloaded weights in (its share of the
    /// node's or superchip's CPU memory), and the link to it, one direction.
    pub host_gib: f64,
    pub host_link_gb_s: f64,
}

impl HardwareKind {
    pub const ALL: [HardwareKind; 7] =
        [Self::H800, Self::H100, Self::H200, Self::B200, Self::Gb200, Self::Gb300, Self::Ascend950];

    pub fn name(self) -> &'static str {
        self.spec().name
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name().eq_ignore_ascii_case(name))
    }

    pub fn spec(self) -> Hardware {
        let h = |name: &'static str,
                 [bf16, fp8]: [f64; 2],
                 fp4: Option<f64>,
                 [hbm_gib, hbm_tb_s]: [f64; 2],
                 [up, out]: [f64; 2],
                 domain: usize,
                 [host, link]: [f64; 2]| {
            Hardware {
                kind: self,
                name,
                bf16_tflops: bf16,
                fp8_tflops: fp8,
                fp4_tflops: fp4,
                hbm_gib,
                hbm_tb_s,
                scale_up_gb_s: up,
                scale_out_gb_s: out,
                scale_up_domain: domain,
                host_gib: host,
                host_link_gb_s: link,
            }
        };
        // HGX parts reach host memory over PCIe Gen5 x16 (64 GB/s a
        // direction); a DGX holds 2 TB of it for 8 GPUs.
        let pcie5_host = [256.0, 64.0];
        match self {
            // SXM5 figures; H800 keeps H100 compute with NVLink cut to 400 GB/s (200 per direction).
            HardwareKind::H800 => h("H800", [989.0, 1979.0], None, [80.0, 3.35], [200.0, 50.0], 8, pcie5_host),
            HardwareKind::H100 => h("H100", [989.0, 1979.0], None, [80.0, 3.35], [450.0, 50.0], 8, pcie5_host),
            HardwareKind::H200 => h("H200", [989.0, 1979.0], None, [141.0, 4.8], [450.0, 50.0], 8, pcie5_host),
            // HGX B200: NVLink 5 (1.8 TB/s, 900 per direction), ConnectX-7 400 Gb/s per GPU.
            HardwareKind::B200 => h("B200", [2250.0, 4500.0], Some(9000.0), [180.0, 8.0], [900.0, 50.0], 8, pcie5_host),
            // GB200 NVL72, per GPU: one 72-GPU NVLink domain; a Grace (480 GB
            // LPDDR5X, NVLink-C2C 900 GB/s both ways) serves two GPUs.
            HardwareKind::Gb200 => {
                h("GB200", [2500.0, 5000.0], Some(10000.0), [186.0, 8.0], [900.0, 50.0], 72, [240.0, 225.0])
            }
            // GB300 NVL72 (Blackwell Ultra), per GPU: 288 GB HBM3e, dense NVFP4
            // 15 PFLOPS, ConnectX-8 800 Gb/s per GPU.
            HardwareKind::Gb300 => {
                h("GB300", [2500.0, 5000.0], Some(15000.0), [288.0, 8.0], [900.0, 100.0], 72, [240.0, 225.0])
            }
            // Ascend 950DT as announced (FP8 1 PFLOPS, FP4 2 PFLOPS, 144 GB at 4 TB/s, 2 TB/s interconnect).
            HardwareKind::Ascend950 => {
                h("Ascend950", [500.0, 1000.0], Some(2000.0), [144.0, 4.0], [1000.0, 50.0], 8, pcie5_host)
            }
        }
    }
}

impl Hardware {
    pub fn bf16_flops(&self) -> f64 {
        self.bf16_tflops * 1e12
    }

    pub fn fp8_flops(&self) -> f64 {
        self.fp8_tflops * 1e12
    }

    pub fn hbm_bytes(&self) -> f64 {
        self.hbm_gib * (1u64 << 30) as f64
    }

    pub fn hbm_bytes_per_s(&self) -> f64 {
        self.hbm_tb_s * 1e12
    }

    pub fn scale_up_bytes_per_s(&self) -> f64 {
        self.scale_up_gb_s * 1e9
    }

    pub fn host_bytes(&self) -> f64 {
        self.host_gib * (1u64 << 30) as f64
    }

    pub fn host_link_bytes_per_s(&self) -> f64 {
        self.host_link_gb_s * 1e9
    }

    pub fn scale_out_bytes_per_s(&self) -> f64 {
        self.scale_out_gb_s * 1e9
    }
}
