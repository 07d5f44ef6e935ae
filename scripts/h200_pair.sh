#!/usr/bin/env bash
# The SmolLM2 draft's training campaign and benchmarks on lent H200s (MLX-CUDA), in steps that fit
# the device tool's 10-minute calls. Run from the repo root after `source .device/N/activate.sh`
# (shared/device/mlx-cuda-prepare.sh with the SmolLM2 GGUF and a copy of its imported tokenizer files
# as smoltok/: EXTRA=gguf==0.19.0, see scripts/h200_target.py). NGPU=2 (on nvidia-h200-x2): data
# parallel over both GPUs through mlx.launch/NCCL (see scripts/train_smollm2_h200.sh).
#   data [PROMPTS_GZ|- [FLAGS]] - generate the data cache in the background (prompts + responses;
#                         resumable); PROMPTS_GZ: the campaign's derived prompts brought back by an
#                         earlier `pack` (benchmark/training/campaign/derived_prompts.jsonl.gz): the
#                         same prompts again, so only the (greedy, deterministic) responses are
#                         redone; `-`: none. FLAGS go to train-draft (give `ab`/`start` the same ones)
#   start BUDGET_S [CK] - a training session in the background: BUDGET_S of training after the
#                         compile steps; CK = a checkpoint folder to --resume (e.g. the committed
#                         benchmark/training/campaign/checkpoint); without CK: a new campaign
#   wait MAX_S          - wait for the background job to finish (or MAX_S), print progress
#   failed [LOG]        - exit 0 when the background job (default $LOG) stopped on an error
#   pack [RUN]          - the checkpoint parts (bf16, <= 15 MB each) + config/trainer/index + a
#                         reports tar + the derived prompts (gzip) into $OUT (8 files, ~50 MB:
#                         within the tool's 8 x 16 MiB, 64 MiB in all)
#   snap [RUN]          - the run's latest periodic checkpoint (--ckpt-every: weights, trainer.json,
#                         config, index) into $OUT when its step is newer than the last snap's: a
#                         machine taken back mid-training (session 32) then loses only what came
#                         after the last call, and the next session resumes from the snap
#   packdata            - the data cache (prompts + responses, JSONL) as xz parts of <= 15 MB into $OUT:
#                         keep them here in .campaign-data/ (ignored) and stage them next session
#                         (mlx-cuda-prepare.sh .campaign-data/*): `data`/`start` unpack them first,
#                         so the responses are not generated again (~8 min of two GPUs). Over a
#                         staged cache it brings only what changed: campaign-delta-<UTC time>.tar.xz.NN
#                         (new files whole, a grown file's new lines as NAME.from-SIZE; see
#                         scripts/campaign_data.py); stage those beside the base parts and `unpack`
#                         applies them in name order. Session 49
#                         lost 20,000 fresh answers when the call ended 2 parts into a 300 MB full
#                         pack whose new lines came last. PACKDATA_FULL=1: the whole cache as before
#   unpack              - the staged base parts and deltas -> the data cache (what data/start do first)
#   ptxpack / ptxrestore - MLX-CUDA's compiled kernels into $OUT (xz) / back from a staged copy
#   bench [FLAGS]       - dflash benchmark of target + draft into $OUT (FLAGS added, e.g. --chat)
#   ttft                - prefix-cache TTFT (cold / L1 / L2) on a 4K-token prompt into $OUT
#                         (needs EXTRA="pyzmq==27.3.0 diskcache==5.6.3" when staging)
# TARGET_DTYPE=float32: the target rebuilt in fp32 from the GGUF (the CPU's weights exactly; a
# bf16 copy upcast later keeps bf16's rounding), for fp32 answers and fp32 features (session 36)
set -uo pipefail
TARGET_DTYPE=${TARGET_DTYPE:-bfloat16}
MODEL=/tmp/stage/files/smol-bf16; [ "$TARGET_DTYPE" = float32 ] && MODEL=/tmp/stage/files/smol-fp32
TRAIN=${CAMPAIGN_TRAIN:-/tmp/train_out}  # CAMPAIGN_*: other places (tests/test_campaign_delta_s49.py)
STAGE=${CAMPAIGN_STAGE:-/tmp/stage/files}
LOG=${CAMPAIGN_LOG:-/tmp/train_stdout.log}
DRAFT=${DRAFT:-$TRAIN}  # bench/ttft: the draft just trained, or e.g. the bundled one staged as a file
ns() {
  mkdir -p /tmp/ns/dflash
  for d in engine cache daemon client launchd; do ln -sfn "$PWD/$d" "/tmp/ns/dflash/$d"; done
  export PYTHONPATH=/tmp/ns:${PYTHONPATH:-} PYTHONUNBUFFERED=1
}
model() {  # the target in TARGET_DTYPE, rebuilt from the staged GGUF + tokenizer files (scripts/h200_target.py)
  [ -d "$MODEL" ] || python3 scripts/h200_target.py /tmp/stage/files/SmolLM2-135M-Instruct.Q4_1.gguf \
    /tmp/stage/files/smoltok "$MODEL" --dtype "$TARGET_DTYPE"
}
failed() {  # did the background job logged in $1 stop on an error? A traceback, or an exit code
  # other than 0 and 130 (Ctrl-C/SIGTERM: the checkpoint saved). train-draft's own errors are one
  # line with no traceback ("Error: --layers 5 contradicts the checkpoint ... (8)", session 46,
  # whose train phase then read as finished and the next call packed and evaluated nothing)
  grep -q '^Traceback' "$1" 2>/dev/null && return 0
  local rc; rc=$(sed -n 's/^TRAIN_DONE rc=//p' "$1" 2>/dev/null | tail -n 1)
  [ -n "$rc" ] && [ "$rc" != 0 ] && [ "$rc" != 130 ]
}
bg() {  # run the training script in its own session, detached from this call; the env it ran
  # with is noted, so h200_session.sh reruns a failed phase only once that env has changed
  md5sum .devq/env 2>/dev/null | cut -c1-8 > /tmp/job_env_sig
  setsid nohup bash -c "bash scripts/train_smollm2_h200.sh $MODEL $TRAIN $*; echo TRAIN_DONE rc=\$?" \
    > "$LOG" 2>&1 < /dev/null &
  sleep 5; tail -3 "$LOG"
}
unpack_data() {  # the staged base parts and deltas -> $TRAIN/data, once (scripts/campaign_data.py);
  # where they cannot make a cache, the job is marked failed (h200_session.sh stops on it) and
  # nothing is started over a half-built one
  python3 scripts/campaign_data.py unpack --stage "$STAGE" --train "$TRAIN" && return 0
  echo "unpack: the staged data cannot be unpacked (above); no job started"
  printf 'unpack failed: the staged data cannot be unpacked\nTRAIN_DONE rc=1\n' > "$LOG"
  exit 1
}
case "$1" in
  failed) failed "${2:-$LOG}" ;;
  unpack) unpack_data ;;
  data)
    model; ns; unpack_data
    if [ -n "${2:-}" ] && [ "$2" != "-" ] && [ ! -f "$TRAIN/data/derived_prompts.jsonl" ]; then
      mkdir -p "$TRAIN/data" && gunzip -c "$2" > "$TRAIN/data/derived_prompts.jsonl"
    fi
    bg --data-only "${@:3}" ;;
  start)  # start BUDGET_S [CK [FLAGS]]: FLAGS go to train-draft (e.g. --gen-batch-size 2048)
    model; ns; unpack_data
    RESUME=""
    if [ -n "${3:-}" ]; then ck=$3; [ "${ck#/}" = "$ck" ] && ck=$PWD/$ck; RESUME="--resume $ck"; fi
    bg --time-budget-s "$2" $RESUME "${@:4}" ;;
  ab)  # ab BUDGET_S CK ARM_A ARM_B [FLAGS]: two single-GPU arms at once (GPU 0 gets ARM_A's
       # train-draft flags, GPU 1 ARM_B's; a plain number N means --kl-weight N), same data cache,
       # same start and schedule, FLAGS to both; each evaluates on the held-out set. E.g.
       # ab 150 CK "" "--miss-anchor-frac 0.5 --early-anchor-frac 0.3" --num-prompts 0 ...
       # CK: a checkpoint (has trainer.json: --resume, the campaign goes on) or a draft (--init-draft).
       # The data must be cached already (`data` with the same FLAGS and DERIVE), else each arm
       # derives and generates its own.
    model; ns; unpack_data
    ck=$3; [ "${ck#/}" = "$ck" ] && ck=$PWD/$ck
    START="--init-draft $ck"
    [ -f "$ck/trainer.json" ] && START="--resume $ck"
    for arm in 0 1; do
      flags=$([ $arm = 0 ] && echo "$4" || echo "$5")
      [[ "$flags" =~ ^[0-9.]+$ ]] && flags="--kl-weight $flags"
      dev=$arm; [ "${NGPU:-2}" -lt 2 ] && dev=0  # one GPU: both arms share it (same budget each)
      CUDA_VISIBLE_DEVICES=$dev NGPU=1 DATA=$TRAIN/data setsid nohup bash -c "bash scripts/train_smollm2_h200.sh \
        $MODEL /tmp/arm$arm --time-budget-s $2 $START $flags ${*:6}; echo TRAIN_DONE rc=\$?" \
        > /tmp/arm$arm.log 2>&1 < /dev/null &
    done
    sleep 20; tail -n 2 /tmp/arm0.log /tmp/arm1.log ;;
  abwait)  # abwait MAX_S
    end=$((SECONDS + $2))
    while [ $SECONDS -lt $end ] && ! { grep -q TRAIN_DONE /tmp/arm0.log && grep -q TRAIN_DONE /tmp/arm1.log; }; do sleep 10; done
    for arm in 0 1; do echo "== arm $arm"; grep -E "^\[(eval|train)\]" /tmp/arm$arm.log | tail -12; done ;;
  wait)
    end=$((SECONDS + $2))
    while [ $SECONDS -lt $end ] && ! grep -q TRAIN_DONE "$LOG"; do sleep 10; done
    grep -E "^\[(data|eval|train)\]" "$LOG" | tail -25
    if grep -q TRAIN_DONE "$LOG"; then  # a crash ends with TRAIN_DONE too: say which it was
      if failed "$LOG"; then echo "FAILED:"; grep -v '^ ' "$LOG" | tail -n 4; else echo "finished"; fi
    fi ;;
  pack)  # pack [RUN]: RUN = a run folder (default the campaign's; e.g. /tmp/arm1 after `ab`)
    # 8 files come back at most: the weight parts, reports.tar (logs, held-out reports and the
    # checkpoint's config.json, model.safetensors.index.json, trainer.json, draft_vocab.json under checkpoint/),
    # the derived prompts unless PROMPTS=0 or too big, and the small files again when
    # they still fit (a grown draft has 5 parts: then only in the tar)
    run=${2:-$TRAIN}
    # the CPU proposes from the draft's vocabulary file: a candidate without it is timed on the
    # whole vocabulary and loses ~7% to the bundled draft for that alone (session 29)
    [ -f "$run"/draft_vocab.json ] && cp "$run"/draft_vocab.json "$run"/checkpoint/
    cp "$run"/checkpoint/model-*.safetensors "$OUT"/
    (cd "$run" && tar cf "$OUT/reports.tar" --exclude=data --exclude=optimizer --exclude='*.safetensors' .)
    if [ "${PROMPTS:-1}" = 1 ]; then  # within the 64 MiB that come back together, else left out
      cat "$TRAIN"/data/derived_prompts*.jsonl | gzip -9 > /tmp/derived_prompts.jsonl.gz
      total=$(( $(cat "$OUT"/* | wc -c) + $(stat -c %s /tmp/derived_prompts.jsonl.gz) ))
      if [ "$total" -lt 66000000 ]; then mv /tmp/derived_prompts.jsonl.gz "$OUT"/
      else echo "pack: derived prompts left out ($total bytes would pass 64 MiB; packdata brings them)"; fi
    fi
    if [ $(( $(ls "$OUT" | wc -l) + 3 )) -le 8 ]; then
      cp "$run"/checkpoint/model.safetensors.index.json "$run"/checkpoint/config.json \
         "$run"/checkpoint/trainer.json "$OUT"/
    fi
    if [ -f "$run"/checkpoint/draft_vocab.json ] && [ $(( $(ls "$OUT" | wc -l) + 1 )) -le 8 ]; then
      cp "$run"/checkpoint/draft_vocab.json "$OUT"/
    fi
    tar tf "$OUT/reports.tar" | grep checkpoint/; ls -la "$OUT" ;;
  snap)
    ck=${2:-$TRAIN}/checkpoint
    [ -f "$ck/trainer.json" ] || { echo "snap: no checkpoint yet"; exit 0; }
    [ -z "$(ls -A "$OUT")" ] || { echo "snap: \$OUT is in use this call; the next call brings it"; exit 0; }
    step=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" "$ck/trainer.json")
    if [ "$step" = "$(cat /tmp/snap_step 2>/dev/null)" ]; then echo "snap: step $step already brought back"; exit 0; fi
    # save_checkpoint swaps the whole folder in by rename every --ckpt-every steps: a copy is kept
    # only when the step read before it, the copy's own and the one read after it agree
    rm -rf /tmp/snap; cp -r "$ck" /tmp/snap 2>/dev/null
    for f in /tmp/snap/trainer.json "$ck/trainer.json"; do
      [ "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" "$f" 2>/dev/null)" = "$step" ] \
        || { echo "snap: a checkpoint was written while copying; the next call brings it"; exit 0; }
    done
    cp /tmp/snap/model-*.safetensors /tmp/snap/model.safetensors.index.json /tmp/snap/config.json \
       /tmp/snap/trainer.json "$OUT"/ && echo "$step" > /tmp/snap_step
    echo "snap: checkpoint at step $step in \$OUT ($(ls "$OUT" | wc -l) files)" ;;
  packdata)  # XZ_THREADS: fewer while a training runs beside it (default all cores)
    if [ -s "$TRAIN/data/.unpacked" ] && [ "${PACKDATA_FULL:-0}" != 1 ]; then
      python3 scripts/campaign_data.py pack-delta --train "$TRAIN" --out "$OUT"; ls -la "$OUT"; exit 0
    fi
    (cd "$TRAIN" && tar cf - --exclude=.unpacked data) | xz -T"${XZ_THREADS:-0}" -6 | split -d -a 2 -b 15000000 - "$OUT/campaign-data.tar.xz."
    ls -la "$OUT" ;;
  ptxrestore)  # the CUDA kernels an earlier session compiled (see ptxpack), staged as a file, once
    f=$STAGE/mlx-ptx-cache.tar.xz
    { [ -f "$f" ] && [ ! -f /tmp/.ptx_restored ]; } || exit 0
    tar xJf "$f" -C "${TMPDIR:-/tmp}" && touch /tmp/.ptx_restored \
      && echo "ptx cache: $(find "${TMPDIR:-/tmp}/mlx" -type f | wc -l) compiled kernels restored" ;;
  ptxpack)  # MLX-CUDA compiles its kernels with NVRTC at first use and keeps them in
    # $TMPDIR/mlx/<version>/ptx: a fresh machine compiles them all again (part of the ~100 s
    # "compile" of every train phase). This brings them back (xz, <= 15 MB) for the next session
    # to stage (ptxrestore); the version in the path keeps another MLX from reading them, and
    # the H100 and the H200 are the same architecture (sm_90)
    d=${TMPDIR:-/tmp}; [ -d "$d/mlx" ] || { echo "ptx cache: none"; exit 0; }
    tar cf - -C "$d" mlx | xz -T0 -6 > /tmp/mlx-ptx-cache.tar.xz
    size=$(stat -c %s /tmp/mlx-ptx-cache.tar.xz)
    if [ "$size" -le 15000000 ]; then
      cp /tmp/mlx-ptx-cache.tar.xz "$OUT/"; echo "ptx cache: $(find "$d/mlx" -type f | wc -l) kernels, $size bytes into \$OUT"
    else echo "ptx cache: $size bytes, too big to bring back"; fi ;;
  bench)
    ns; model
    python3 -m dflash.engine.bench --model "$MODEL" --draft "$DRAFT" --contexts 128,1024 --max-tokens 256 \
      --repeats 3 --warmup 1 --cooldown 2 --label smollm2-135m-dflash-h200 --out "$OUT" "${@:2}" 2>&1 | tail -30 ;;
  ttft)
    ns; model
    python3 -m dflash.cache.bench --model "$MODEL" --draft "$DRAFT" --tokens 4096 --repeats 3 \
      --out "$OUT/prefix_cache_ttft_smollm2_135m_h200.json" 2>&1 | tail -30 ;;
esac
