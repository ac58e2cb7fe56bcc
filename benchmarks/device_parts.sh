# Sourced by the CPU device scripts (cpu_device.sh, cpu_experts_device.sh, cpu_mla_amx_device.sh):
# parts that share one time budget and fail soft. Set PREFIX (output files $OUT/${PREFIX}_NAME.txt)
# and BUDGET (seconds for all parts, counted from the script's start: SECONDS=0) before sourcing.
# run NAME SECONDS COMMAND...: runs COMMAND with at most SECONDS and at most what is left of
# BUDGET (skipped under 5 s), output to $OUT/${PREFIX}_NAME.txt, a line in ${PREFIX}_summary.txt.
: >"$OUT/${PREFIX}_summary.txt"
run() {
  local name=$1 secs=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  ((secs > left)) && secs=$left
  if ((secs < 5)); then
    echo "## $name: skipped (time budget spent)" | tee -a "$OUT/${PREFIX}_summary.txt"
    return
  fi
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/${PREFIX}_$name.txt" 2>&1
  echo "## $name: rc $? in $((SECONDS - t0)) s (limit $secs)" | tee -a "$OUT/${PREFIX}_summary.txt"
}
