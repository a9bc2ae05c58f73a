#!/usr/bin/env bash
# The online workload (bench/overhead.py --online) A/B of this checkout ("new") against an earlier attn-otel
# ("old") on one warm GPU machine of the device tool, in calls that each fit its 10-minute limit; the figures
# and each server's capture stats come back under $OUT/ab/.  vLLM is staged by ../shared/tools/gpu-vllm
# (carry .gpu/b0, then .gpu/b1, one call each), then:
#
#   here:    git archive --format=tar.gz -o .gpu/old.tgz COMMIT
#   call 1:  bash bench/online_ab.sh setup        (carry .gpu/b2 and .gpu/old.tgz: stages vLLM, installs both,
#                                                  serves capture off; a fresh machine compiles for ~220 s;
#                                                  or "install" and "off" in two calls, other work between)
#   call 2:  bash bench/online_ab.sh ab 1 new old  (the default of each, one server after the other)
#   call 3:  bash bench/online_ab.sh ab 2 old new  (the other order)
#   (a server's name may carry one variable for it: "ab 3 new@ATTN_OTEL_AFTER_LAUNCH=0 new" A/Bs a switch of
#   this checkout, no old one needed; each configuration once a call, as its file is named by the call's
#   number: "ab 1 new off && ab 2 off new" in one device command for more; "off" is one more capture-off
#   server, online-off-N.json: with several, the report pools them and shows how far they drift apart, the
#   noise every ratio of the call sits in)
#
# The device tool gives an idle machine back after 30 s, which a reply between two calls easily takes (session
# 46 lost two machines so): send the staging calls and the calls after them together, so they run back to back.
#
# Then, here: the calls' ab/ files in one folder, and python3 bench/online_report.py --dir FOLDER --png FILE
# (a row a server, each configuration's runs pooled and paired by seed, every run plotted); --reference NAME
# takes one configuration's servers as the reference instead of capture off (two capturing configurations A/B'd).
#
# Where the engine loop's time goes, capture off against on (run 33): py-spy on each server's engine core,
#   here:    .venv/bin/python -m pip download py-spy==0.4.2 --no-deps --only-binary :all: -d .gpu/scripts
#   call:    bash bench/online_ab.sh profile off && bash bench/online_ab.sh profile default   (after install; carry
#            .gpu/scripts; ~300 s for the two on a warm machine, REPEATS runs each; "profile
#            default@ATTN_OTEL_LAUNCH=jit" profiles the default with one variable, into $OUT/pp/NAME/; "profile
#            old" the old checkout's default, into $OUT/pp/old/; PROFILE_TIMEOUT_S for a first server that compiles)
#   here:    python3 bench/host_profile.py DIR/pyspy-online-default.txt --against DIR/pyspy-online-off.txt
#
# Ratios compare servers of one machine: off, then new and old in both orders.  The load is 80% of the capacity
# (req/s) that the "off" step measures on this machine (every request sent at once; an H100 gave 39.47 in run 15,
# an H200 47.7 in run 36) and the later steps read back; CAPACITY=REQ_S pins it instead (runs 21-35 pinned
# 39.47 on every H100). REPEATS (default 3) sets the measured runs a server: the ITL p99 of one run spreads by up
# to 20 ms at this load (runs 22-25), so more runs a server buy more than more servers.
set -uo pipefail
measured() {  # the capacity the "off" step measured here (it runs first: setup, or off after install)
  python3 -c "import json; print(json.load(open('${AB_OFF_JSON:-/tmp/ab/off/online-off.json}'))['capacity_req_s'])" \
    2>/dev/null \
    || { echo "no capacity measured on this machine yet: run 'off' first, or set CAPACITY" >&2; return 1; }
}
cap=${CAPACITY:-0}  # 0: overhead.py measures it (the "off" step); the steps after it read it back (measured)
reps=${REPEATS:-3}  # measured runs a server (each ~14 s at this load; a server's start is ~100 s on a warm machine)
case "${1:-}" in
setup)  # install, then off
  bash "$0" install && bash "$0" off
  ;;
install)  # stage vLLM's last batch, install this checkout and the old one (/tmp/old)
  bash .gpu/b2/stage.sh > /tmp/stage2.log 2>&1 || { tail -20 /tmp/stage2.log; exit 1; }
  source /tmp/gpu-env.sh
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
  mkdir -p /tmp/oldsrc && tar -xzf .gpu/old.tgz -C /tmp/oldsrc
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/old /tmp/oldsrc \
    > /tmp/pip-old.log 2>&1 || { tail -20 /tmp/pip-old.log; exit 1; }
  nvidia-smi --query-gpu=name,uuid --format=csv,noheader
  ;;
off)  # capture off, the ratios' reference, and this machine's capacity unless CAPACITY pins it (a fresh machine
  # compiles for ~220 s first)
  source /tmp/gpu-env.sh
  mkdir -p /tmp/ab/off "$OUT/ab"
  timeout 540 python3 bench/overhead.py --online off --capacity "$cap" --repeats "$reps" --out /tmp/ab/off \
    > /tmp/ab/off.log 2>&1
  echo "off rc $?"; grep -E "^\[online|Error" /tmp/ab/off.log | tail -5
  cp /tmp/ab/off/online-off.json "$OUT/ab/"
  ;;
profile)  # one server (off, or this checkout's default) with py-spy on its engine core: $OUT/pp/pyspy-online-PHASE.txt
  # (default@ATTN_OTEL_X=V: the default with one variable; its files go to $OUT/pp/NAME/, NAME the spec in
  # letters, digits and _, so that two of them in one call keep theirs)
  # ("old": the default of the old checkout installed by "install", its files under $OUT/pp/old/)
  spec=${2:-}; ph=${spec%%@*}; var=""; [ "$spec" != "$ph" ] && var=${spec#*@}
  case "$ph" in off|default|old) ;; *) echo "profile: give the phase, off, default or old (not '$ph')"; exit 2 ;; esac
  [ -n "$var" ] && [ "$ph" = off ] && { echo "profile: a variable is for the default, not off"; exit 2; }
  name=$ph${var:+-${var//[^A-Za-z0-9]/_}}
  pp=""; [ "$ph" = old ] && { pp="/tmp/old:"; ph=default; }
  spydir=${PYSPY_DIR:-/tmp/pyspy}  # where the wheel is unpacked, once a machine
  if [ ! -x "$spydir/spy" ]; then
    whl=$(ls .gpu/scripts/py_spy-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || { echo "no py-spy wheel in .gpu/scripts (see this script's header)"; exit 1; }
    mkdir -p "$spydir" && (cd "$spydir" && python3 -m zipfile -e "$OLDPWD/$whl" .)
    spy=$(find "$spydir" -name py-spy -type f | head -1); chmod +x "$spy"; ln -sf "$spy" "$spydir/spy"
  fi
  # the capacity measured here before, else a capture-off server measures it; a capturing one needs it
  [ -n "${CAPACITY:-}" ] || { cap=$(measured 2>/dev/null) || cap=0; }
  [ "$cap" = 0 ] && [ "$ph" != off ] && { measured >/dev/null; exit 1; }
  source /tmp/gpu-env.sh
  keep=$OUT/pp; [ -n "$var" ] || [ -n "$pp" ] && keep=$OUT/pp/$name
  mkdir -p "/tmp/pp-$name" "$keep"
  PYTHONPATH=$pp${PYTHONPATH:-} BENCH_PYSPY=$spydir/spy timeout ${PROFILE_TIMEOUT_S:-$((300 + 20 * reps))} python3 bench/overhead.py --online "$ph" ${var:+--env "$var"} \
    --capacity "$cap" --repeats "$reps" --out "/tmp/pp-$name" > "/tmp/pp-$name.log" 2>&1
  echo "$name rc $?"; grep -E "^\[online|Error|py-spy" "/tmp/pp-$name.log" | tail -6
  cp "/tmp/pp-$name"/online-*.json "/tmp/pp-$name"/pyspy-* "$keep/" 2>/dev/null
  ;;
ab)
  [ -n "${CAPACITY:-}" ] || cap=$(measured) || exit 1
  source /tmp/gpu-env.sh
  run=$2; shift 2
  # A fresh machine (no vLLM compile cache yet: the machine was given back since the last call) compiles for
  # ~220 s before its first server serves; session 53 lost a server to the usual time limit so. That server gets
  # the compile's time on top (SERVER_TIMEOUT_S sets every server's limit instead).
  compile=0; [ -d "${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/torch_compile_cache" ] || {
    compile=240; echo "ab: no vLLM compile cache on this machine (a fresh one): the first server may take ${compile} s more"; }
  for spec in "$@"; do  # new, old, or either with one attn-otel variable for its server: new@ATTN_OTEL_AFTER_LAUNCH=0
    # (overhead.py --env: the phase clears every other ATTN_OTEL variable, so a plain environment one is lost)
    d=${spec%%@*}; var=""; [ "$spec" != "$d" ] && var=${spec#*@}
    name=$d${var:+-${var//[^A-Za-z0-9]/_}}
    dir=/tmp/ab/$name-$run
    mkdir -p "$dir" "$OUT/ab"
    # capture off ("off": one more reference server, online-off-N.json) or attn-otel's default of new or old
    if [ "$d" = off ]; then phase=off; keep=$OUT/ab/online-off-$run.json
    else phase=default; keep=$OUT/ab/online-default-$name-$run.json; cp /tmp/ab/off/online-off.json "$dir/" 2>/dev/null; fi
    if [ -e "$keep" ]; then  # session 46 lost a server this way (both new-1)
      echo "$name: already served in call $run (a configuration once a call: give the next its own call number)"
      continue
    fi
    pp=""; [ "$d" = old ] && pp="/tmp/old:"
    PYTHONPATH=$pp${PYTHONPATH:-} timeout ${SERVER_TIMEOUT_S:-$((225 + 20 * reps + compile))} python3 bench/overhead.py \
      --online "$phase" ${var:+--env "$var"} --capacity "$cap" --repeats "$reps" --out "$dir" \
      > "$dir.log" 2>&1
    echo "$name rc $?"; grep -E "^\[online|Error" "$dir.log" | tail -5
    compile=0
    cp "$dir/online-$phase.json" "$keep"
    [ "$phase" = off ] && continue
    python3 - "$dir/online-default.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
c = r.get("capture", {})
print(r.get("attn_otel"), {k: c.get(k) for k in (
    "finish_batch_sizes", "finish_batch_reasons", "empty_steps", "stream_spilled_blocks", "side_stream_waits",
    "side_stream_wait_causes", "upload_ring_waits", "stream_flushes", "stream_flush_times", "step_host_s",
    "spill_at", "block_hold", "step_times", "gc_pauses", "step_intervals")},
      r.get("env"))
PY
  done
  ;;
*)
  sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2
  ;;
esac
