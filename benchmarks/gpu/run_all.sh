#!/usr/bin/env bash
# Every figure of benchmarks/gpu/README.md, in one run on a machine with a GPU:
#   bash benchmarks/gpu/run_all.sh RESULTS_DIR
# the GPU's calibration (python -m fairscale calibrate), the GPU checks, then the bench: Hugging Face's Llama and
# our GPT at the same sizes (1.0-1.1 B parameters).
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'; nproc; } > "$out/env.txt" 2>&1
python3 -m fairscale calibrate 2>&1 | tee "$out/calibrate.log"
python3 benchmarks/gpu/gpu_checks.py --out "$out/checks.json" 2>&1 | tee "$out/checks.log"
python3 benchmarks/gpu/bench_llama.py --model llama --width 2048 --layers 16 --batch 8 --out "$out/llama.json" 2>&1 | tee "$out/llama.log"
python3 benchmarks/gpu/bench_llama.py --model gpt --width 2048 --layers 16 --batch 8 --out "$out/gpt.json" 2>&1 | tee "$out/gpt.log"
