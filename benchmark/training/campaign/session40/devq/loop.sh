# One device call: scripts/h200_session.sh's phases back to back until one writes $OUT (pack,
# final) or the call's time runs short, so no call comes back only to start the next phase
start=$SECONDS
while :; do
  left=$((570 - (SECONDS - start)))
  [ $left -lt 40 ] && break
  out=$(CALL_S=$left bash scripts/h200_session.sh 2>&1); echo "$out"
  ph=$(echo "$out" | sed -n 's/^== phase \([a-z]*\).*/\1/p' | head -1)
  case "$ph" in pack|final|done|"") break ;; esac
  echo "$out" | grep -q "FAILED" && break
done
echo "== loop.sh $((SECONDS - start)) s"
