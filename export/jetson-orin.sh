#!/usr/bin/env bash
# Recipe: Jetson Orin (JetPack 6.2 = TensorRT 10.3; JetPack 7 = TensorRT 10.x). Make the export on any machine,
# copy the folder to the Orin, then build the engines there (they are tied to its TensorRT and GPU):
#   host:  dflash2 export --target T --drafter D --out EXPORT --dtype fp16 --block-size 8 --max-seq-len 2048 \
#            --quantize int8
#   orin:  EXPORT=... ./export/jetson-orin.sh
# Block size 8 (not 16): an edge GPU pays more per verified row. --quantize int8 (the default here) adds
# target_qdq.onnx: int8 weights, one symmetric scale per output channel, behind per-axis DequantizeLinear at the
# export's opset (17; per-axis DequantizeLinear needs 13), which build-engines then uses for the target engine:
# about half the target's fp16 weight memory, the usual reason to quantize on an 8 GB Orin. int4 (blockwise,
# opset 21, a quarter of the memory) is NOT the default: nothing yet shows TensorRT 10.3 (JetPack 6.2) parsing
# an opset-21 int4 Q/DQ graph; use it only after checking on the device (QUANTIZE=int4 lets this script accept
# such an export). TensorRT on the Orin is JetPack's own (apt: nvidia-tensorrt / python3-libnvinfer; L4T
# builds): PyPI's aarch64 tensorrt wheels are for SBSA servers (Grace), not Jetson — never pip-install them
# there. The script prints the export's memory budget first: an 8 GB Orin shares its memory between CPU and
# GPU, and the OS + CUDA context take ~2-2.5 GB of it.
# Status: never run (no Jetson here).
set -euo pipefail
: "${EXPORT:?set EXPORT to an fp16 export folder made with --quantize int8}"
PLUGIN=${PLUGIN:-build/lib/libdflash2_plugins.so}
QUANTIZE=${QUANTIZE:-int8}  # what the export must carry: int8 (default), int4 (checked on this TensorRT first), none
python - "$EXPORT" "$QUANTIZE" <<'PY'
import sys
from pathlib import Path
from dflash2_trt.manifest import read_manifest

d = Path(sys.argv[1])
m = read_manifest(d, verify_checksums=False)
if m.quantization.kind != sys.argv[2]:
    sys.exit(f"jetson-orin: {d} is quantized '{m.quantization.kind}', this recipe expects '{sys.argv[2]}' "
             f"(export with --quantize int8; QUANTIZE=none or QUANTIZE=int4 to override)")
t, c = m.target, m.drafter_config
elem = 2 if m.dtype in ("fp16", "bf16") else 4
weights = sum((d / f).stat().st_size for f in m.files if f.endswith((".bin", ".onnx", ".data")))
if m.quantization.kind != "none":
    print(f"quantized export ({m.quantization.kind}): the target engine is built from target_qdq; the files "
          "below also hold the unquantized graphs")
kv_target = 2 * t.num_layers * t.num_key_value_heads * t.head_dim * elem * m.max_capacity
kv_drafter = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.head_dim or 0) * elem * m.max_capacity
gib = 1 << 30
print(f"memory budget of {d}: weights {weights / gib:.2f} GiB (engines take about the same), "
      f"KV caches {(kv_target + kv_drafter) / gib:.2f} GiB at {m.max_capacity} positions, "
      f"plus TensorRT scratch (reported at engine build)")
PY
dflash2 build-engines "$EXPORT" --plugin "$PLUGIN" --selector plugin --prefill-rows 128
dflash2 generate --model-dir "$EXPORT" --backend trt --chat --prompt "Hello" --max-new-tokens 64
