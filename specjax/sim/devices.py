"""Spec-sheet device profiles, and `"32xGB200"` parsing.

All rates below are the vendors' **nominal** published figures ("spec sheet" values, quoted
from memory of the documents named; no network was available to re-check them), per device:

| profile | bf16 dense FLOP/s | HBM | HBM bandwidth | scale-up link, per direction | domain |
|---|---|---|---|---|---|
| H100  | 989 T  | 80 GB   | 3.35 TB/s | NVLink 4: 900 GB/s total -> 450 GB/s | 8 (HGX) |
| H200  | 989 T  | 141 GB  | 4.8 TB/s  | NVLink 4: 450 GB/s | 8 (HGX) |
| B200  | 2.25 P | 180 GB  | 8 TB/s    | NVLink 5: 1.8 TB/s total -> 900 GB/s | 8 (HGX) |
| GB200 | 2.5 P  | 186 GB  | 8 TB/s    | NVLink 5: 900 GB/s | 72 (NVL72) |
| TPU v5e | 197 T | 16 GB  | 819 GB/s  | ICI 1,600 Gb/s -> 100 GB/s | 256 (pod) |
| TPU v5p | 459 T | 95 GB  | 2,765 GB/s | ICI 4,800 Gb/s -> 300 GB/s | 8,960 (pod) |
| TPU v6e | 918 T | 32 GB  | 1,640 GB/s | ICI 3,584 Gb/s -> 224 GB/s | 256 (pod) |

Sources: "NVIDIA H100 Tensor Core GPU" datasheet (SXM5), "NVIDIA H200 Tensor Core GPU"
datasheet (SXM), "NVIDIA HGX B200 / DGX B200" datasheets (per GPU = board total / 8), "NVIDIA
GB200 NVL72" datasheet (per GPU = rack total / 72: 180 PFLOP/s dense bf16, 13.4 TB HBM3e,
576 TB/s, 130 TB/s NVLink), Google Cloud TPU v5e / v5p / v6e ("Trillium") system-architecture
pages. NVIDIA quotes bf16 with 2:4 sparsity as twice the dense figure; the dense one is used.
An ICI or NVLink figure quoted per device for both directions is halved. Scale-out (between
domains) is one 400 Gb/s NIC per GPU (ConnectX-7: 50 GB/s); for TPUs the DCN share per chip
(12.5 GB/s v5e, 25 GB/s v5p / v6e) is an assumption, not a spec-sheet figure.

Efficiency assumptions (not from spec sheets; typical published kernel results, to be
replaced by `fit_efficiency` on measured runs):
- matmul: 30% of peak at intensity 16 FLOP/byte, 60% at 128, 75% from 512 on (GPUs; cuBLAS
  large bf16 GEMMs reach ~70-80%); TPUs 35 / 70 / 85% (the MXU runs large matmuls closer
  to peak).
- weight streaming: 80% of HBM bandwidth (GPUs), 85% (TPUs); KV reads by size: 25% at 1 MiB,
  65% at 64 MiB, 80% from 1 GiB per forward and device (TPUs 30 / 70 / 85%);
  attention products 50% of peak.
- fixed costs: 8 us per layer per forward on GPUs (CUDA graphs; 4 us TPUs), 0.5 ms per decoding
  round (scheduler, sampler; 0.3 ms TPUs), 0.3 ms more per speculative round.
- trainer MFU 40%; collectives reach 80% of the link at 10 us latency (GPUs; 5 us TPUs).
- logits: the sampler's passes over the float32 logits of every verified position move 12
  bytes per logit (log-softmax: read, write, read) plus 8 for a draw (noise, argmax), at the
  weights' 80% (85%) of HBM bandwidth.
"""

from __future__ import annotations

import re

from specjax.errors import ConfigError
from specjax.sim.hardware import Curve, DeviceProfile

GB, TB = 1e9, 1e12

_GPU = dict(
    matmul_eff=Curve(((16, 0.30), (128, 0.60), (512, 0.75))), mem_eff=0.80,
    kv_eff=Curve(((2**20, 0.25), (2**26, 0.65), (2**30, 0.80))), attn_flops_eff=0.50,
    layer_overhead_s=8e-6, round_overhead_s=5e-4, spec_round_overhead_s=3e-4, train_mfu=0.40,
    collective_eff=0.80, collective_latency_s=1e-5)
_TPU = dict(
    matmul_eff=Curve(((16, 0.35), (128, 0.70), (512, 0.85))), mem_eff=0.85,
    kv_eff=Curve(((2**20, 0.30), (2**26, 0.70), (2**30, 0.85))), attn_flops_eff=0.50,
    layer_overhead_s=4e-6, round_overhead_s=3e-4, spec_round_overhead_s=3e-4, train_mfu=0.40,
    collective_eff=0.80, collective_latency_s=5e-6)

_SPECS = {
    "h100": ("H100 SXM", 989e12, 3.35 * TB, 80 * GB, 450 * GB, 50 * GB, 8, _GPU,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM5), nominal"),
    "h200": ("H200 SXM", 989e12, 4.8 * TB, 141 * GB, 450 * GB, 50 * GB, 8, _GPU,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM), nominal"),
    "b200": ("B200 (HGX)", 2.25e15, 8 * TB, 180 * GB, 900 * GB, 50 * GB, 8, _GPU,
             "NVIDIA HGX B200 / DGX B200 datasheets, per GPU, nominal"),
    "gb200": ("GB200 (NVL72)", 2.5e15, 8 * TB, 186 * GB, 900 * GB, 50 * GB, 72, _GPU,
              "NVIDIA GB200 NVL72 datasheet, rack totals / 72, nominal"),
    "v5e": ("TPU v5e", 197e12, 819 * GB, 16 * GB, 100 * GB, 12.5 * GB, 256, _TPU,
            "Google Cloud TPU v5e system architecture page, nominal; DCN share assumed"),
    "v5p": ("TPU v5p", 459e12, 2765 * GB, 95 * GB, 300 * GB, 25 * GB, 8960, _TPU,
            "Google Cloud TPU v5p system architecture page, nominal; DCN share assumed"),
    "v6e": ("TPU v6e", 918e12, 1640 * GB, 32 * GB, 224 * GB, 25 * GB, 256, _TPU,
            "Google Cloud TPU v6e (Trillium) system architecture page, nominal; DCN assumed"),
}
DEVICE_NAMES = ("H100", "H200", "B200", "GB200", "TPU-v5e", "TPU-v5p", "TPU-v6e")


def _key(name: str) -> str:
  return re.sub(r"[\s_\-]|^tpu", "", name.strip().lower())


_LOGIT_BYTES, _SAMPLE_BYTES = 12.0, 8.0


def device_profile(name: str) -> DeviceProfile:
  """The spec-sheet profile of a device (`H100`, `GB200`, `TPU-v5e`/`v5e`, ...)."""
  spec = _SPECS.get(_key(name)) if isinstance(name, str) else None
  if spec is None:
    raise ConfigError(f"device {name!r} is unknown: allowed {', '.join(DEVICE_NAMES)} "
                      "(case-insensitive; TPU names also as v5e, v5p, v6e)")
  title, peak, bw, cap, link, out, domain, eff, source = spec
  streaming = bw * eff["mem_eff"]
  return DeviceProfile(name=f"{title} (spec sheet)", peak_flops=peak, hbm_bw=bw, hbm_bytes=cap,
                       link_bw=link, scaleout_bw=out, domain=domain, source=source,
                       logit_s=_LOGIT_BYTES / streaming, sample_logit_s=_SAMPLE_BYTES / streaming,
                       **eff)


def parse_devices(text: str) -> tuple[DeviceProfile, int]:
  """`"32xGB200"` -> (the GB200 profile, 32); a bare name is one device."""
  match = re.fullmatch(r"\s*(?:(\d+)\s*[x*]\s*)?([A-Za-z][\w\- ]*?)\s*", text or "")
  if match is None:
    raise ConfigError(f"devices={text!r} is invalid: write COUNTxNAME, e.g. 32xGB200, with NAME "
                      f"one of {', '.join(DEVICE_NAMES)}")
  count = int(match.group(1)) if match.group(1) else 1
  if count < 1:
    raise ConfigError(f"devices={text!r} is invalid: the count must be >= 1")
  return device_profile(match.group(2)), count
