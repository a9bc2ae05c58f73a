// The attn-otel viewer (attn_otel/viewer.py): plain JavaScript over a canvas; no library, no network but,
// when served, this page's own map requests.  Data: the JSON in #attn-otel-data; maps: log-coded uint8,
// causal rows packed (row i: keys 0..i), zlib-compressed, embedded as base64 (file) or fetched (served).
"use strict";
(() => {
  const D = JSON.parse(document.getElementById("attn-otel-data").textContent);
  const $ = (id) => document.getElementById(id);
  const T = D.num_tokens, N = D.prompt_len, L = D.layers.length, H = D.num_heads;
  const VIRIDIS = hexBytes("44015444025645045745055946075a46085c460a5d460b5e470d60470e6147106347116447136548146748166848176948186a481a6c481b6d481c6e481d6f481f70482071482173482374482475482576482677482878482979472a7a472c7a472d7b472e7c472f7d46307e46327e46337f463480453581453781453882443983443a83443b84433d84433e85423f854240864241864142874144874045884046883f47883f48893e49893e4a893e4c8a3d4d8a3d4e8a3c4f8a3c508b3b518b3b528b3a538b3a548c39558c39568c38588c38598c375a8c375b8d365c8d365d8d355e8d355f8d34608d34618d33628d33638d32648e32658e31668e31678e31688e30698e306a8e2f6b8e2f6c8e2e6d8e2e6e8e2e6f8e2d708e2d718e2c718e2c728e2c738e2b748e2b758e2a768e2a778e2a788e29798e297a8e297b8e287c8e287d8e277e8e277f8e27808e26818e26828e26828e25838e25848e25858e24868e24878e23888e23898e238a8d228b8d228c8d228d8d218e8d218f8d21908d21918c20928c20928c20938c1f948c1f958b1f968b1f978b1f988b1f998a1f9a8a1e9b8a1e9c891e9d891f9e891f9f881fa0881fa1881fa1871fa28720a38620a48621a58521a68522a78522a88423a98324aa8325ab8225ac8226ad8127ad8128ae8029af7f2ab07f2cb17e2db27d2eb37c2fb47c31b57b32b67a34b67935b77937b87838b9773aba763bbb753dbc743fbc7340bd7242be7144bf7046c06f48c16e4ac16d4cc26c4ec36b50c46a52c56954c56856c66758c7655ac8645cc8635ec96260ca6063cb5f65cb5e67cc5c69cd5b6ccd5a6ece5870cf5773d05675d05477d1537ad1517cd2507fd34e81d34d84d44b86d54989d5488bd6468ed64590d74393d74195d84098d83e9bd93c9dd93ba0da39a2da37a5db36a8db34aadc32addc30b0dd2fb2dd2db5de2bb8de29bade28bddf26c0df25c2df23c5e021c8e020cae11fcde11dd0e11cd2e21bd5e21ad8e219dae319dde318dfe318e2e418e5e419e7e419eae51aece51befe51cf1e51df4e61ef6e620f8e621fbe723fde725");
  const FUTURE = [246, 246, 246], NAN = [221, 221, 221];
  const MAX_PX = 720, CACHE = 8, FLOOR = Math.log10(D.log_floor);
  const VALUES = new Float32Array(256);  // code -> the weight it stands for
  for (let c = 1; c < 256; c++) VALUES[c] = Math.pow(10, FLOOR * (1 - (c - 1) / D.steps));
  const STRIPS = { entropy_norm: "entropy", sink_mass_first: "sink[0]", sink_mass_k: "sink[0:" + D.sink_tokens + "]",
                   vision_share: "vision", lookback_ratio: "lookback", learned_sink_mass: "learned sink" };
  const OVERVIEW = { "prompt.entropy_norm": "entropy (norm.), prompt", "prompt.sink_mass_first": "sink mass on token 0",
                     "prompt.sink_mass_k": "sink mass on tokens 0-" + (D.sink_tokens - 1), "prompt.vision_share": "vision share",
                     "prompt.learned_sink_mass": "learned sink mass",
                     "generated.entropy_norm": "entropy (norm.), generated", "generated.lookback_ratio": "lookback ratio" };
  const BASE = location.origin + location.pathname.replace(/\/+$/, "");
  const state = { li: 0, head: "mean", log: false, q: null, entry: null, token: 0, draws: 0 };
  const cache = new Map(), rows = {}, stripCache = new Map();
  const G = geometry();

  function hexBytes(hex) { const out = new Uint8Array(hex.length / 2); for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.substr(2 * i, 2), 16); return out; }
  function base64Bytes(text) { const bin = atob(text.trim()); const out = new Uint8Array(bin.length); for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i); return out; }
  async function inflate(bytes) {
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }
  function f16(text) {  // base64 little-endian float16 -> Float32Array
    const b = base64Bytes(text), dv = new DataView(b.buffer), out = new Float32Array(b.length / 2);
    for (let k = 0; k < out.length; k++) {
      const h = dv.getUint16(2 * k, true), s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 31, m = h & 1023;
      out[k] = e === 0 ? s * m * Math.pow(2, -24) : e === 31 ? (m ? NaN : s * Infinity) : s * (1 + m / 1024) * Math.pow(2, e - 15);
    }
    return out;
  }
  function viridis(t) { const k = Math.min(255, Math.max(0, Math.round(t * 255))) * 3; return [VIRIDIS[k], VIRIDIS[k + 1], VIRIDIS[k + 2]]; }
  function css(rgb) { return "rgb(" + rgb.join(",") + ")"; }
  function fmt(v) { return v >= 0.01 ? v.toFixed(3) : v > 0 ? v.toExponential(1) : "0"; }
  function headName() { return state.head === "mean" ? "mean over " + H + " heads" : "head " + state.head; }
  function label(j) { return D.labels ? D.labels[j] : String(j); }
  function shortLabel(j) {
    if (!D.labels) return "";
    const s = D.label_kind === "tokens" ? JSON.stringify(D.labels[j]) : "id " + D.labels[j];
    return " " + (s.length > 16 ? s.slice(0, 15) + "…" : s);
  }
  function geometry() {
    const f = T > MAX_PX ? Math.ceil(T / MAX_PX) : 1, cells = Math.ceil(T / f);
    const s = f > 1 ? 1 : Math.max(1, Math.floor(MAX_PX / T)), labelled = !!D.labels && T <= 64;
    const margin = labelled ? 96 : 46;
    return { f, cells, s, labelled, left: margin, top: 8, bottom: margin, size: cells * s };
  }
  function setStatus(text) { $("status").textContent = text; }
  function showError(e) {
    const msg = String((e && e.message) || e);
    $("error").hidden = false; $("error").textContent = msg; document.body.dataset.error = msg;
  }

  // --- maps ------------------------------------------------------------------------------------------
  async function loadMap(li, head) {
    const key = li + "-" + head;
    if (cache.has(key)) { const hit = cache.get(key); cache.delete(key); cache.set(key, hit); return hit; }
    let compressed;
    if (D.maps.source === "file") {
      const el = document.getElementById("attn-otel-map-" + key);
      if (!el) return null;
      compressed = base64Bytes(el.textContent);
    } else {
      const params = new URLSearchParams({ layer: D.layers[li], head: head, request: D.request_id });
      const resp = await fetch(BASE + "/map?" + params, { credentials: "same-origin" });
      if (!resp.ok) throw new Error("map of layer " + D.layers[li] + ", " + headName() + ": HTTP " + resp.status + " " + (await resp.text()));
      compressed = new Uint8Array(await resp.arrayBuffer());
    }
    const codes = await inflate(compressed);
    if (codes.length !== T * (T + 1) / 2) throw new Error("map " + key + " has " + codes.length + " codes, expected " + T * (T + 1) / 2);
    let top = 0;
    for (let k = 0; k < codes.length; k++) if (codes[k] > top) top = codes[k];
    const entry = { codes, top, pooled: pool(codes) };
    cache.set(key, entry);
    if (cache.size > CACHE) cache.delete(cache.keys().next().value);
    return entry;
  }
  function pool(codes) {  // the max over each cell's f x f tokens: a sharp peak stays visible when pooled
    const f = G.f, n = G.cells, out = new Uint8Array(n * n);
    for (let i = 0, off = 0; i < T; off += ++i) {
      const row = ((i / f) | 0) * n;
      if (f === 1) { out.set(codes.subarray(off, off + i + 1), row); continue; }
      for (let j = 0; j <= i; j++) { const k = row + ((j / f) | 0), v = codes[off + j]; if (v > out[k]) out[k] = v; }
    }
    return out;
  }
  function colours(top) {  // code -> RGB under the current scale
    const rgb = new Uint8Array(768);
    for (let c = 0; c < 256; c++) {
      const t = state.log ? (c === 0 ? 0 : top > 1 ? (c - 1) / (top - 1) : 1) : (top ? VALUES[c] / VALUES[top] : 0);
      rgb.set(viridis(t), 3 * c);
    }
    return rgb;
  }
  function drawMap() {
    const cv = $("map"), ctx = cv.getContext("2d"), n = G.cells, e = state.entry;
    cv.width = G.left + G.size + 10; cv.height = G.top + G.size + G.bottom;
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
    if (e) {
      const img = ctx.createImageData(n, n), rgb = colours(e.top), px = img.data;
      for (let r = 0; r < n; r++) for (let c = 0; c < n; c++) {
        const p = 4 * (r * n + c), k = 3 * e.pooled[r * n + c];
        if (c > r) { px[p] = FUTURE[0]; px[p + 1] = FUTURE[1]; px[p + 2] = FUTURE[2]; } else { px[p] = rgb[k]; px[p + 1] = rgb[k + 1]; px[p + 2] = rgb[k + 2]; }
        px[p + 3] = 255;
      }
      const off = document.createElement("canvas"); off.width = n; off.height = n; off.getContext("2d").putImageData(img, 0, 0);
      ctx.imageSmoothingEnabled = false; ctx.drawImage(off, G.left, G.top, G.size, G.size);
    } else {
      ctx.fillStyle = "#f4f4f4"; ctx.fillRect(G.left, G.top, G.size, G.size);
    }
    ctx.strokeStyle = "#999"; ctx.lineWidth = 1; ctx.strokeRect(G.left - 0.5, G.top - 0.5, G.size + 1, G.size + 1);
    if (N > 0 && N < T) {  // the prompt | generated boundary
      const b = N / G.f * G.s;
      ctx.save(); ctx.strokeStyle = "#e41a1c"; ctx.setLineDash([5, 4]); ctx.beginPath();
      ctx.moveTo(G.left + b, G.top); ctx.lineTo(G.left + b, G.top + G.size); ctx.moveTo(G.left, G.top + b); ctx.lineTo(G.left + G.size, G.top + b);
      ctx.stroke(); ctx.restore();
    }
    if (state.q !== null) {
      const r = (state.q / G.f) | 0;
      ctx.strokeStyle = "#d62728"; ctx.lineWidth = 2; ctx.strokeRect(G.left - 1, G.top + r * G.s - 1, (r + 1) * G.s + 2, G.s + 2);
    }
    drawAxes(ctx);
  }
  function drawAxes(ctx) {
    ctx.fillStyle = "#333"; ctx.font = "10px system-ui, sans-serif";
    const at = (j) => (j / G.f + 0.5) * G.s;
    let ticks = [];
    if (G.labelled) ticks = [...Array(T).keys()];
    else { const raw = T / 8, p = Math.pow(10, Math.floor(Math.log10(raw))), step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || p;
           for (let j = 0; j < T; j += Math.max(1, step)) ticks.push(j); }
    for (const j of ticks) {
      const text = G.labelled ? (j + ": " + label(j).replace(/\n/g, "↵")).slice(0, 14) : String(j);
      ctx.textAlign = "right"; ctx.textBaseline = "middle"; ctx.fillText(text, G.left - 4, G.top + at(j));
      ctx.save(); ctx.translate(G.left + at(j), G.top + G.size + 4); ctx.rotate(-Math.PI / 2); ctx.fillText(text, 0, 0); ctx.restore();
    }
  }

  // --- metric strips ----------------------------------------------------------------------------------
  function metricRows(name) { if (!(name in rows)) rows[name] = f16(D.row_metrics[name]); return rows[name]; }
  function strip(name) {  // per map cell: the metric over its rows, for this layer and head (or the head mean)
    const key = name + ":" + state.li + ":" + state.head;
    if (stripCache.has(key)) return stripCache.get(key);
    const data = metricRows(name), out = new Float32Array(G.cells).fill(NaN), heads = state.head === "mean" ? [...Array(H).keys()] : [+state.head];
    for (let r = 0; r < G.cells; r++) {
      let sum = 0, n = 0;
      for (let i = r * G.f; i < Math.min(T, (r + 1) * G.f); i++) for (const h of heads) {
        const v = data[(state.li * H + h) * T + i]; if (!Number.isNaN(v)) { sum += v; n++; }
      }
      if (n) out[r] = sum / n;
    }
    stripCache.set(key, out);
    return out;
  }
  function drawStrips() {
    const cv = $("strips"), names = Object.keys(STRIPS).filter((n) => n in D.row_metrics), W = 16, GAP = 5;
    cv.hidden = !names.length;
    if (!names.length) return;
    cv.width = names.length * (W + GAP) + 4; cv.height = G.top + G.size + G.bottom;
    const ctx = cv.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
    names.forEach((name, k) => {
      const x = 2 + k * (W + GAP), values = strip(name);
      for (let r = 0; r < G.cells; r++) { ctx.fillStyle = css(Number.isNaN(values[r]) ? NAN : viridis(values[r])); ctx.fillRect(x, G.top + r * G.s, W, G.s); }
      ctx.save(); ctx.fillStyle = "#333"; ctx.font = "10px system-ui, sans-serif"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.translate(x + W / 2, G.top + G.size + 4); ctx.rotate(-Math.PI / 2); ctx.fillText(STRIPS[name], 0, 0); ctx.restore();
    });
  }
  function drawOverview() {
    const grid = $("overview"), head = state.head;
    grid.textContent = ""; grid.style.gridTemplateColumns = "max-content repeat(" + L + ", minmax(2.8rem, 4.5rem))";
    const add = (cls, text, onclick) => { const d = document.createElement("div"); d.className = cls; d.textContent = text; if (onclick) d.addEventListener("click", onclick); grid.appendChild(d); return d; };
    add("name", "layer");
    D.layers.forEach((layer, li) => add("head", String(layer), () => select(li)));
    for (const [key, title] of Object.entries(OVERVIEW)) {
      const stats = D.overview[key];
      if (!stats) continue;
      add("name", title);
      D.layers.forEach((layer, li) => {
        const v = head === "mean" ? stats.layer_mean[li] : stats.mean[li][+head];
        const cell = add("cell" + (li === state.li ? " current" : ""), v === null ? "–" : v.toFixed(3), () => select(li));
        cell.title = title + ", layer " + layer + ", " + headName() + ": " + (v === null ? "undefined" : v);
        if (v !== null) { cell.style.background = css(viridis(v)); cell.style.color = v < 0.6 ? "#fff" : "#000"; }
      });
    }
    $("layers-what").textContent = "(" + headName() + "; click a layer to show its map)";
  }

  // --- the selected query row ---------------------------------------------------------------------------
  function showRow(i) {
    state.q = i; writeHash();
    const e = state.entry, off = i * (i + 1) / 2, vals = new Float32Array(i + 1);
    if (e) for (let j = 0; j <= i; j++) vals[j] = VALUES[e.codes[off + j]];
    let max = 0; vals.forEach((v) => { if (v > max) max = v; });
    const top = [...vals.keys()].sort((a, b) => vals[b] - vals[a]).slice(0, 5);
    $("row-title").textContent = "Query " + i + shortLabel(i) + " (" + (i < N ? "prompt" : "generated") + "), layer " + D.layers[state.li] + ", " + headName()
      + (e ? ": most attended " + top.map((j) => j + shortLabel(j) + " " + fmt(vals[j])).join(", ") : ": no map to read the row from");
    // the row's own scale: linear from 0 to its largest weight, or log over the 3 decades below it
    const level = (v) => (v <= 0 || !max ? 0 : state.log ? Math.max(0, 1 + Math.log10(v / max) / 3) : v / max);
    const cv = $("row-bars"), W = Math.min(960, Math.max(240, (i + 1) * 8)), Hb = 80, ctx = cv.getContext("2d");
    cv.width = W; cv.height = Hb + 4; ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, Hb + 4);
    for (let x = 0; x < W; x++) {
      const a = Math.floor(x * (i + 1) / W), b = Math.max(a + 1, Math.floor((x + 1) * (i + 1) / W));
      let v = 0; for (let j = a; j < b && j <= i; j++) v = Math.max(v, vals[j]);
      const t = level(v); ctx.fillStyle = css(viridis(t)); ctx.fillRect(x, Hb - t * Hb + 2, 1, t * Hb);
    }
    if (N > 0 && N <= i) { ctx.fillStyle = "#e41a1c"; ctx.fillRect(Math.round(N * W / (i + 1)), 0, 1, Hb + 4); }
    const text = $("row-text"), frag = document.createDocumentFragment();
    for (let j = 0; j < T; j++) {
      const s = document.createElement("span");
      s.textContent = D.label_kind === "tokens" ? label(j) : label(j) + " ";
      s.dataset.pos = j;
      s.className = (j > i ? "future" : "") + (j === i ? " query" : "") + (j >= N ? " generated" : "");
      if (j <= i) { s.style.background = "rgba(255, 127, 14, " + level(vals[j]).toFixed(3) + ")"; s.title = j + ": " + fmt(vals[j]); }
      frag.appendChild(s);
    }
    text.textContent = ""; text.appendChild(frag);
    document.body.dataset.row = String(i);
  }

  // --- state, controls --------------------------------------------------------------------------------
  const timings = [];  // [view, ms] per render: what bench/viewer_open.py reads
  async function render() {
    const token = ++state.token, t0 = performance.now();
    setStatus("loading layer " + D.layers[state.li] + ", " + headName() + " …");
    let entry = null, why = "";
    if (!D.has_maps) why = "No maps were stored for this request (metrics only): below are its per-layer metrics.";
    else {
      try {
        entry = await loadMap(state.li, state.head);
        if (!entry) why = "This file does not embed the map of layer " + D.layers[state.li] + ", " + headName() + " (maps were capped at " + D.maps.limit_mb
          + " MB; attn-otel view --max-mb embeds more, and the viewer on the vLLM server reads any of them).";
      } catch (err) { showError(err); }
    }
    if (token !== state.token) return;  // a later choice won
    state.entry = entry; $("note").textContent = why;
    drawMap(); drawStrips(); drawOverview();
    if (state.q !== null) showRow(state.q);
    writeHash();
    state.draws++;
    timings.push([state.li + "-" + state.head, performance.now() - t0, performance.now()]);
    Object.assign(document.body.dataset, { draws: String(state.draws), ready: "1", view: state.li + "-" + state.head + "-" + (state.log ? 1 : 0) });
    setStatus("layer " + D.layers[state.li] + ", " + headName() + (state.log ? ", log scale" : "") + (G.f > 1 ? " · " + G.f + "×" + G.f + " tokens per pixel (max)" : ""));
  }
  function select(li) { state.li = li; $("layer").value = String(li); render(); }
  function writeHash() {
    const p = new URLSearchParams({ layer: D.layers[state.li], head: state.head, log: state.log ? 1 : 0 });
    if (state.q !== null) p.set("q", state.q);
    history.replaceState(null, "", location.pathname + location.search + "#" + p);
  }
  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1)), li = D.layers.indexOf(+p.get("layer")), head = p.get("head"), q = +p.get("q");
    if (p.has("layer") && li >= 0) state.li = li;
    if (head === "mean" || (head !== null && +head >= 0 && +head < H && head !== "")) state.head = head;
    state.log = p.get("log") === "1";
    if (p.has("q") && q >= 0 && q < T) state.q = q;
  }
  function option(sel, value, text) { const o = document.createElement("option"); o.value = value; o.textContent = text; sel.appendChild(o); }
  function init() {
    readHash();
    $("trace").textContent = D.trace_id;
    const when = D.created ? new Date(D.created * 1000).toISOString().replace(/\.\d+Z$/, "Z") : "?";
    $("facts").textContent = "request " + D.request_id + " · model " + (D.model || "?") + " · " + T + " tokens (" + N + " prompt, " + (T - N) + " generated) · "
      + L + " layers × " + H + " heads · finish " + (D.finish_reason || "?") + " · " + when + " · axes: "
      + { tokens: "decoded tokens", ids: "token ids (no tokenizer given)", positions: "positions (token ids not stored)" }[D.label_kind];
    D.requests.forEach((r) => option($("request"), r, r));
    $("request").value = D.request_id; $("request").parentElement.hidden = D.requests.length < 2;
    $("request").disabled = D.maps.source === "file";
    $("request").addEventListener("change", (ev) => { location.search = "?request=" + encodeURIComponent(ev.target.value); });
    D.layers.forEach((layer, li) => option($("layer"), li, String(layer)));
    option($("head"), "mean", "mean over " + H + " heads");
    for (let h = 0; h < H; h++) option($("head"), h, String(h));
    $("layer").value = String(state.li); $("head").value = state.head; $("log").checked = state.log;
    $("layer").addEventListener("change", (ev) => { state.li = +ev.target.value; render(); });
    $("head").addEventListener("change", (ev) => { state.head = ev.target.value; render(); });
    $("log").addEventListener("change", (ev) => { state.log = ev.target.checked; render(); });
    $("map").addEventListener("click", (ev) => {
      const cv = ev.currentTarget, rect = cv.getBoundingClientRect(), y = (ev.clientY - rect.top) * cv.height / rect.height - G.top;
      if (y < 0 || y >= G.size) return;
      showRow(Math.min(T - 1, Math.floor(y / G.s) * G.f)); drawMap();
    });
    $("map").addEventListener("mousemove", (ev) => {
      const cv = ev.currentTarget, rect = cv.getBoundingClientRect(), e = state.entry;
      const r = Math.floor(((ev.clientY - rect.top) * cv.height / rect.height - G.top) / G.s), c = Math.floor(((ev.clientX - rect.left) * cv.width / rect.width - G.left) / G.s);
      if (!e || r < 0 || c < 0 || r >= G.cells || c > r) return;
      setStatus("query " + r * G.f + shortLabel(r * G.f) + ", key " + c * G.f + shortLabel(c * G.f) + ": " + fmt(VALUES[e.pooled[r * G.cells + c]]) + (G.f > 1 ? " (max of " + G.f + "×" + G.f + ")" : ""));
    });
    $("row-text").addEventListener("click", (ev) => { const pos = ev.target.dataset && ev.target.dataset.pos; if (pos !== undefined) { showRow(+pos); drawMap(); } });
    const left = D.maps.left_out || [];
    $("legend").textContent = "Colour: attention weight, viridis, " + "linear from 0 to the map's largest weight, or log from " + D.log_floor + " (log scale); grey: future keys (causal). "
      + "Red dashes: the prompt | generated boundary. " + (Object.keys(D.row_metrics).length
        ? "Strips: per-row metrics of the layer (" + Object.keys(STRIPS).filter((n) => n in D.row_metrics).map((n) => STRIPS[n]).join(", ") + "; 0 to 1, grey where undefined)."
        : "This capture stored no per-row metrics (ATTN_OTEL_ROW_METRICS), only the per-layer means below.")
      + (left.length ? " This file leaves out " + left.length + " maps (cap " + D.maps.limit_mb + " MB)." : "");
    $("figure").hidden = $("row-panel").hidden = $("legend").hidden = !D.has_maps;
    $("footer").textContent = D.has_maps ? "Weights are drawn to within about 3% (log-coded). Exact maps: " : "As a table: ";
    const code = document.createElement("code");
    code.textContent = "attn-otel " + (D.has_maps ? "fetch " : "metrics ") + D.trace_id + " --request " + D.request_id;
    $("footer").appendChild(code);
    render();
  }
  window.addEventListener("error", (ev) => showError(ev.error || ev.message));
  window.addEventListener("unhandledrejection", (ev) => showError(ev.reason));
  window.attnOtel = { data: D, state, geometry: G, timings, render, showRow, select };
  init();
})();
