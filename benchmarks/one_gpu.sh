#!/usr/bin/env bash
# The real-GPU figures one GPU can give, in one run (docs/gpus.md, "Measured on one H100"):
#   bash benchmarks/one_gpu.sh OUT_DIR [PART ...]     (parts: speed fp8 train context moe_switch; default all)
# 1. jfsdp's train step, llama-1b, bf16, remat full, 8 x 2048 tokens: tokens/s, MFU, the allocator's peak
#    beside XLA's compiled figure (benchmarks/throughput.py);
# 2. the same model, batch and settings with PyTorch FSDP2 (transformers' Llama, torchtitan's recipe)
#    beside jfsdp: tokens/s and each side's allocator peak (benchmarks/torch_compare.py --only speed);
# 3. float8 unit matmuls (--precision fp8 and fp8-rowwise) on the same step;
# 4. train.py end to end on the default corpus (llama-small, 1x1): the loss it reaches;
# 5. context: the ring's cuDNN per-block kernel, its errors and speed (benchmarks/context_cudnn.py);
# 6. moe_switch: an adaptive MoE stage's device-side switch on XLA:GPU (moe-test, 1x1): the same taken
#    branch with one bucket (no conditional) and with three (lax.switch), tokens/s of each; then three again
#    with conditionals allowed into command buffers (CUDA graphs), and the thunks that XLA made of them; and
#    three chosen on the host (--moe-switch host: one program per bucket, no conditional).
# Each part has its own time limit and log, so one failure does not hide the others. The whole takes about
# 7 to 9 minutes on one H100 (2026-11-26: the bf16 and fp8 parts 1-2 minutes each, train.py 30 s); run the parts
# you need where the device time is shorter.
# On one device FSDP shards nothing: these are compute, memory and allocator figures, not communication.
set -u
out=${1:?usage: bash benchmarks/one_gpu.sh OUT_DIR [PART ...]}
shift
parts=" ${*:-speed fp8 train context moe_switch} "
want() { [[ "$parts" == *" $1 "* ]]; }
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
common=(--models llama-1b --strategies full_shard --mesh 1x1 --remat full --batch-size 8 --seq-len 2048
        --warmup 3 --steps 10)
{ nvidia-smi -L; $py -c "import jax, flax, optax, torch, transformers as t; print('jax', jax.__version__, jax.devices(), \
'flax', flax.__version__, 'optax', optax.__version__, 'torch', torch.__version__, 'transformers', t.__version__)"; } \
    2>&1 | tee "$out/env.log"
want speed && timeout 170 $py benchmarks/throughput.py "${common[@]}" --precision bf16 --json "$out/throughput_bf16.json" 2>&1 \
    | grep -v "^W0000\|^I0000" | tee "$out/throughput_bf16.log"
want speed && timeout 300 $py benchmarks/torch_compare.py --only speed --device cuda --speed-worlds 1 --speed-model llama-1b \
    --speed-batch 8 --speed-seq 2048 --speed-precision bf16 --speed-remat full --speed-warmup 3 --speed-steps 10 \
    --json "$out/torch_compare_speed.json" 2>&1 | grep -v "^W0000\|^I0000" | tee "$out/torch_compare.log"
want fp8 && for p in fp8 fp8-rowwise; do
    timeout 240 $py benchmarks/throughput.py "${common[@]}" --precision $p --json "$out/throughput_$p.json" 2>&1 \
        | grep -v "^W0000\|^I0000" | tee "$out/throughput_$p.log"
done
want train && timeout 120 $py train.py --mesh 1x1 --model llama-small --precision bf16 --remat full --steps 300 --eval-every 100 \
    --log-every 50 --metrics-out "$out/train_metrics.jsonl" 2>&1 | grep -v "^W0000\|^I0000" | tail -40 \
    | tee "$out/train.log"
want context && timeout 270 $py benchmarks/context_cudnn.py --json "$out/context_cudnn.json" 2>&1 \
    | grep -v "^W0000\|^I0000" | tee "$out/context_cudnn.log"
if want moe_switch; then
    for b in 256 64,128,256; do
        timeout 100 $py train.py --mesh 1x1 --model moe-test --moe adaptive --moe-buckets $b --steps 200 --log-every 50 \
            --eval-every 0 --gen-tokens 0 --metrics-out "$out/moe_switch_${b//,/-}.jsonl" 2>&1 | grep -v "^W0000\|^I0000" \
            | tail -12 | tee "$out/moe_switch_${b//,/-}.log"
    done
    # the three buckets chosen on the host (--moe-switch host): one program per bucket, no conditional
    timeout 100 $py train.py --mesh 1x1 --model moe-test --moe adaptive --moe-buckets 64,128,256 --moe-switch host \
        --steps 200 --log-every 50 --eval-every 0 --gen-tokens 0 --metrics-out "$out/moe_switch_host.jsonl" 2>&1 \
        | grep -v "^W0000\|^I0000" | tail -12 | tee "$out/moe_switch_host.log"
    # the three buckets again with conditionals allowed into CUDA graphs (command buffers): whether this XLA then
    # captures the conditional (its thunk sequence, dumped) and the host's wait for the branch index goes away
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE \
--xla_dump_to=$out/moe_switch_cb_dump --xla_dump_hlo_module_re=.*step.*" timeout 100 $py train.py --mesh 1x1 --model moe-test \
        --moe adaptive --moe-buckets 64,128,256 --steps 200 --log-every 50 --eval-every 0 --gen-tokens 0 \
        --metrics-out "$out/moe_switch_cb.jsonl" 2>&1 | grep -v "^W0000\|^I0000" | tail -12 | tee "$out/moe_switch_cb.log"
    grep -ho "k[A-Z][A-Za-z]*" "$out"/moe_switch_cb_dump/*thunk_sequence_after_thunk_passes.txt 2>/dev/null | sort | uniq -c \
        | tee "$out/moe_switch_cb_thunks.txt"
fi
ls -l "$out"
