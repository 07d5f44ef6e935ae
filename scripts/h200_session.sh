#!/usr/bin/env bash
# One call of a whole campaign session on the lent H200s, made again and again by a "pump" (a
# helper agent that only calls the device tool back to back, so the machine never idles 30 s and
# is never given back while a background job runs). Each call does the next phase, then waits
# up to W seconds on the background job and returns:
#
#   data -> train -> pack -> packdata -> final -> ALL_DONE   (phase markers in /tmp/ph_*)
#
# Nothing waits for the end to come back (session 32 lost a whole session's data and training
# when the machine was taken back mid-run): the train call also brings the fresh data cache back
# (packdata beside the training, when DATA=1 and PACKDATA=1), and every later call of the train
# phase brings the newest periodic checkpoint (`h200_pair.sh snap`, every 1,000 steps). Keep
# what each call returns (ret/s<session>-callN): the next session stages those data parts and
# resumes from the last checkpoint.
#
#   run(command="bash scripts/h200_session.sh", carry=[".device/N", ".devq"])  (after staging)
#
# Settings (env, read at every call, so a change before the next call takes effect):
#   DERIVE=N        (required) prompts the target has written in all: the staged cache's count
#                   (297,817 after session 11) trains on the cache as it is, more derives and
#                   answers the difference first (~60K new: ~450 s on two GPUs)
#   DATA=1          run the data phase (0: skip it; then DERIVE must be the cache's count)
#   BUDGET=420      training seconds after the compile;  TOTAL_STEPS=...  the cosine's end
#   RESTART_LR=4e-4 a warm restart at the resume step ("" for none);  W=75  seconds to wait a call
#   CALL_S=585      the call returns by then (the device's limit is 600 s): W is cut to what is left
#   NGPU=2          GPUs (1 on nvidia-h200: give TRAIN_FLAGS="--seqs-per-batch 32" to keep the
#                   2,048-block step);  TRAIN_FLAGS=...  more train-draft flags for the train phase
#   DATA_FLAGS=...  train-draft flags for the data phase and the train phase alike (they make and
#                   read the same cache), e.g. "--dtype float32 --sampled-responses 0"
#   GEN_BATCH=2048  rows a generation batch (data phase and train phase alike; batches are
#                   also cut to fit the GPU: 0.9 of its memory over 3x the KV, engine/training/data.py)
#   PACKDATA=1      bring the data cache back (0: the cache did not change, DATA=0)
#   ARM_B="FLAGS"   an A/B train phase instead: two arms from the staged draft at once, arm 0 with
#                   ARM_A's extra train-draft flags (default none), arm 1 with ARM_B's, BUDGET each
#                   (one GPU: both share it); each evaluates on the held-out set, `pack` brings arm
#                   PACK_ARM (default 1) as h200_pair.sh `pack` brings a run, and the other arm's
#                   reports (reports_armN.tar). E.g. ARM_B="--grow-layers 3". Two arms on one
#                   GPU need an H200: on an 80 GB H100 both ran out of memory at their first step
#                   (session 40, 32 sequences a step each)
# Hooks, in the ignored .devq/ (carried): .devq/env, sourced first at every call, overrides the
# settings above for the calls still to come (the pump's command line stays as it is);
# .devq/job.sh runs once per content at the start of a call (not while packing): the session's
# own GPU work beside the campaign; .devq/final.sh runs after packdata (the GPUs free), and then
# the script prints ALL_DONE. pack/packdata write $OUT alone (8 files at most come back).
set -uo pipefail
N=$(ls -d .device/*/activate.sh 2>/dev/null | head -1)
# activate.sh ends by importing MLX on the GPU, which fails (cudaMallocManaged: out of memory)
# while a background job holds the GPU's memory (session 32: the data job at --gen-batch-size
# 2048); this call then only waits (bash) and the job goes on, so that is no failure
if ! source "$N" > /tmp/act.log 2>&1; then
  if [ -f /tmp/train_stdout.log ] && ! grep -q TRAIN_DONE /tmp/train_stdout.log && grep -q "out of memory" /tmp/act.log; then
    echo "== the GPU is busy with the background job: waiting only"
  else tail -5 /tmp/act.log; exit 1; fi
fi
[ -f .devq/env ] && . .devq/env
export MLX_CUDA_USE_CUDNN_SDPA=0 PYTHONUNBUFFERED=1 NGPU=${NGPU:-2}
bash scripts/h200_pair.sh ptxrestore  # kernels compiled by an earlier session, when staged
# DATA is this script's switch; train_smollm2_h200.sh reads DATA as the data cache's folder, so it
# must not reach it (session 9: DATA=0 made the trainer look for its cache in ./0 and stop)
DATA_PHASE=${DATA:-1}; unset DATA
LOG=/tmp/train_stdout.log
# sessions 3-5's prompts, not trained on: a file no rank appends to (data-s10/s11; with one GPU the
# cache's derived_prompts.jsonl is the shard new prompts go to, and train-draft refuses it)
# (session 36 staged no data: then nothing to exclude). DATA_FLAGS: more flags for the data phase
# AND the train phase, which answers any prompts the cache still lacks with the same settings
# (e.g. DATA_FLAGS="--dtype float32 --sampled-responses 0": fp32 greedy answers)
EXCL=""; ls /tmp/stage/files/campaign-data.tar.xz.* > /dev/null 2>&1 \
  && EXCL="--exclude-prompts /tmp/train_out/data/derived_prompts.s3-5.jsonl"
FLAGS="--gen-batch-size ${GEN_BATCH:-2048} --num-prompts 0 $EXCL --sampled-responses 0.5 ${DATA_FLAGS:-}"
RESTART=${RESTART_LR-4e-4}
# the train phase's flags, for the campaign's run and for both arms of an A/B alike
TRAIN_ARGS=(--miss-anchor-frac 0.5 --early-anchor-frac 0.3 ${RESTART:+--restart-lr $RESTART} $FLAGS ${TRAIN_FLAGS:-})
done_bg() { grep -q TRAIN_DONE "$LOG" 2>/dev/null; }
data_sig() { find /tmp/train_out/data -type f -printf '%p %s\n' 2>/dev/null | sort | md5sum; }
AB=${ARM_B+1}
train_done() {  # the campaign's run, or both arms of an A/B
  if [ -n "$AB" ]; then grep -q TRAIN_DONE /tmp/arm0.log 2>/dev/null && grep -q TRAIN_DONE /tmp/arm1.log 2>/dev/null
  else done_bg; fi
}
# a background job that stopped on an error (session 34: the data phase ran an H100 out of
# memory, wrote TRAIN_DONE, and the next call went on to the train phase, which regenerated the
# same data and failed the same way): stop here, and rerun the phase that failed only once
# .devq/env differs from the env the job ran with (h200_pair.sh's bg notes it in /tmp/job_env_sig;
# session 49 changed the env after a failure and still had to change it a second time, because
# the signature was taken at the first call that saw the failure, with the changed env)
if [ -z "$AB" ] && done_bg && bash scripts/h200_pair.sh failed "$LOG"; then
  sig=$(md5sum .devq/env 2>/dev/null | cut -c1-8)
  if [ "$(cat /tmp/job_env_sig 2>/dev/null)" = "$sig" ]; then
    [ -f /tmp/failed_kept ] || { cp "$LOG" "/tmp/failed_$(date +%s).log"; touch /tmp/failed_kept; }
    echo "== FAILED: the background job stopped on an error; change .devq/env and call again to rerun its phase"
    grep -v '^ ' "$LOG" | tail -n 6; exit 3
  fi
  rm -f /tmp/failed_kept
  if [ -f /tmp/ph_train ]; then rm -f /tmp/ph_train; else rm -f /tmp/ph_data; fi
  echo TRAIN_DONE > "$LOG"; echo "== .devq/env changed: the phase that failed runs again"
fi
# an A/B arm that stopped on an error (session 40: both arms ran an H100 out of memory at their
# first step, and the next call packed their empty runs as if they had finished): say so, stop
if [ -n "$AB" ] && [ -f /tmp/ph_train ] && [ ! -f /tmp/ph_pack ] && train_done; then
  for arm in 0 1; do
    if bash scripts/h200_pair.sh failed /tmp/arm$arm.log; then
      echo "== FAILED: arm $arm stopped on an error (/tmp/arm$arm.log); change .devq/env and start the train phase again (rm /tmp/ph_train)"
      grep -v '^ ' /tmp/arm$arm.log | tail -n 4; exit 3
    fi
  done
fi
phase=wait
if [ ! -f /tmp/ph_data ]; then phase=data
elif done_bg && [ ! -f /tmp/ph_train ]; then phase=train
elif [ -f /tmp/ph_train ] && train_done && [ ! -f /tmp/ph_pack ]; then phase=pack
elif [ -f /tmp/ph_pack ] && [ ! -f /tmp/ph_packdata ]; then phase=packdata
elif [ -f /tmp/ph_packdata ] && [ ! -f /tmp/ph_final ]; then phase=final
elif [ -f /tmp/ph_final ]; then phase=done
fi
echo "== phase $phase $(date +%T)"
if [ -f .devq/job.sh ] && [ "$phase" != pack ] && [ "$phase" != packdata ]; then
  id=$(md5sum .devq/job.sh | cut -c1-8)
  if [ ! -f "/tmp/devq_done_$id" ]; then
    touch "/tmp/devq_done_$id"; echo "== job $id"
    timeout "${JOB_S:-420}" bash .devq/job.sh 2>&1 | tail -n 80; echo "== job $id rc ${PIPESTATUS[0]}"
  fi
fi
case $phase in
  data)
    if [ "$DATA_PHASE" = 1 ]; then
      DERIVE=${DERIVE:?set DERIVE} bash scripts/h200_pair.sh data - $FLAGS
    else  # nothing to make: the training reads the staged cache
      echo TRAIN_DONE > "$LOG"
    fi
    touch /tmp/ph_data ;;
  train)
    grep -E "^\[data\]" "$LOG" | tail -3
    if [ -n "$AB" ]; then
      DERIVE=${DERIVE:?set DERIVE} TOTAL_STEPS=${TOTAL_STEPS:?set TOTAL_STEPS} bash scripts/h200_pair.sh ab \
        "${BUDGET:-420}" /tmp/stage/files/draft "${ARM_A:-}" "$ARM_B" "${TRAIN_ARGS[@]}"
      touch /tmp/ph_train
      exit 0
    fi
    DERIVE=${DERIVE:?set DERIVE} TOTAL_STEPS=${TOTAL_STEPS:?set TOTAL_STEPS} bash scripts/h200_pair.sh start \
      "${BUDGET:-420}" /tmp/stage/files/draft "${TRAIN_ARGS[@]}"
    touch /tmp/ph_train
    if [ "$DATA_PHASE" = 1 ] && [ "${PACKDATA:-1}" = 1 ]; then  # the new data, home now
      sleep 60  # the trainer reads the cache first (and answers any prompts DERIVE still lacks)
      data_sig > /tmp/packed_sig  # before the pack: lines appended while it runs make the packdata phase pack again
      XZ_THREADS=6 nice -n 10 bash scripts/h200_pair.sh packdata | tail -n 6
    fi ;;
  pack)
    if [ -n "$AB" ]; then
      bash scripts/h200_pair.sh abwait 0
      # arm PACK_ARM as `pack` brings a run (its checkpoint's small files in reports.tar); the
      # other arm's logs and held-out reports beside it (the data did not change: no prompts)
      # the other arm's reports first: pack counts what $OUT holds before it adds the small
      # files (8 files come back at most; they are in reports.tar as well)
      a=$((1 - ${PACK_ARM:-1}))
      (cd /tmp/arm$a && tar cf "$OUT/reports_arm$a.tar" --exclude=data --exclude=checkpoint --exclude='*.safetensors' .)
      PROMPTS=0 bash scripts/h200_pair.sh pack "/tmp/arm${PACK_ARM:-1}"
    else
      bash scripts/h200_pair.sh wait 0; PROMPTS=${PACKDATA:-1} bash scripts/h200_pair.sh pack
    fi
    touch /tmp/ph_pack; exit 0 ;;
  packdata)
    if [ "${PACKDATA:-1}" = 1 ] && [ "$(data_sig)" != "$(cat /tmp/packed_sig 2>/dev/null)" ]; then
      bash scripts/h200_pair.sh packdata
    else echo "packdata: the data cache came back with the train call, unchanged since"; fi
    touch /tmp/ph_packdata; exit 0 ;;
  final)
    touch /tmp/ph_final
    [ -f .devq/final.sh ] && timeout "${FINAL_S:-500}" bash .devq/final.sh 2>&1 | tail -n 60
    bash scripts/h200_pair.sh ptxpack  # this machine's compiled kernels, for the next session
    echo ALL_DONE; exit 0 ;;
  done) echo ALL_DONE; exit 0 ;;
esac
# the wait ends inside the device's per-call limit whatever ran before it in this call (session
# 35: job.sh's 145 s and W=480 came to 600 s, and the call was cut off at the limit)
wait_s=$(( ${CALL_S:-585} - SECONDS )); [ "$wait_s" -gt "${W:-75}" ] && wait_s=${W:-75}; [ "$wait_s" -lt 0 ] && wait_s=0
if [ -n "$AB" ] && [ -f /tmp/ph_train ]; then bash scripts/h200_pair.sh abwait "$wait_s" | tail -n 8
else
  bash scripts/h200_pair.sh wait "$wait_s" | tail -n 6
  [ -f /tmp/ph_train ] && bash scripts/h200_pair.sh snap
fi
exit 0  # still running is not a failure (the pump reads rc)
