// The live transcription page of `glmasr serve` (index.html). Plain browser JavaScript, no build step, no
// dependencies. It speaks OpenAI's Realtime transcription protocol (GA shape) to /v1/realtime on the same host:
// the microphone goes through an AudioWorklet that resamples to 24 kHz mono PCM16, and every ~50 ms a block goes
// out as input_audio_buffer.append. Turns end at pauses (server_vad) or when the user presses "End turn"
// (turn_detection null, the page commits). Each item's text is grey while it streams in (the delta events) and
// black once its completed event arrives; items are ordered by previous_item_id. The file picker posts to
// /v1/audio/transcriptions.
//
// URL options (override the form's defaults): ?vad=0 (manual turns), ?partials=1, ?language=en. ?record=1 keeps
// every client event the page sent, as the exact JSON text, in window.glmasr.recording (tests replay it to get
// the server's transcript for the very samples the page sent); it grows without bound, so it is off by default.
"use strict";

(() => {
  const OUT_RATE = 24000;
  const BLOCK_MS = 50;                      // one append per 50 ms of audio
  const KEY_STORE = "glmasr.apiKey";
  const DRAIN_TIMEOUT_MS = 30000;           // after stop: how long to wait for the last items' text
  const DEFAULT_MODEL = "glm-asr-nano-2512";
  // The server's opt-in partials extension (audio.input.transcription.interim_results): the text two drafts
  // of the open turn agree on arrives early as ordinary delta events, never retracted.
  const PARTIALS_FIELD = "interim_results";

  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);

  // --- the AudioWorklet: any input rate -> 24 kHz PCM16 blocks --------------------------------------------
  // Windowed-sinc interpolation (Blackman window, cutoff a little below the lower Nyquist), taps from a table
  // with linear interpolation between its points; at 24 kHz input the samples pass through untouched. "flush"
  // (a port message) emits what is buffered, then posts "flushed", so a commit follows the last sample.
  const WORKLET = `
  const OUT_RATE = ${OUT_RATE}, BLOCK = ${(OUT_RATE * BLOCK_MS) / 1000}, RES = 64;
  class Pcm24k extends AudioWorkletProcessor {
    constructor() {
      super();
      this.step = sampleRate / OUT_RATE;
      this.pass = Math.abs(this.step - 1) < 1e-9;
      const fc = Math.min(1, 1 / this.step) * 0.9;     // cutoff as a fraction of the input Nyquist
      this.half = this.pass ? 0 : Math.ceil(12 / fc);   // taps on each side
      this.tab = new Float32Array(this.half * RES + 2);
      for (let i = 0; i < this.tab.length; i++) {
        const d = i / RES, x = Math.PI * fc * d, w = d / this.half;
        const sinc = d === 0 ? 1 : Math.sin(x) / x;
        const win = w >= 1 ? 0 : 0.42 + 0.5 * Math.cos(Math.PI * w) + 0.08 * Math.cos(2 * Math.PI * w);
        this.tab[i] = fc * sinc * win;
      }
      this.buf = new Float32Array(0);
      this.t = 0;                                        // input position of the next output sample
      this.out = new Int16Array(BLOCK);
      this.n = 0;
      this.port.onmessage = (e) => { if (e.data === "flush") this.flush(); };
    }
    tap(d) {
      const a = Math.abs(d) * RES, i = Math.floor(a);
      if (i + 1 >= this.tab.length) return 0;
      return this.tab[i] + (this.tab[i + 1] - this.tab[i]) * (a - i);
    }
    at(t) {
      let acc = 0, norm = 0;
      const lo = Math.ceil(t - this.half), hi = Math.floor(t + this.half);
      for (let k = lo; k <= hi; k++) {
        const h = this.tap(t - k);
        norm += h;
        if (k >= 0 && k < this.buf.length) acc += this.buf[k] * h;
      }
      return norm > 0 ? acc / norm : 0;
    }
    emit(v) {
      const s = v > 1 ? 1 : v < -1 ? -1 : v;
      this.out[this.n++] = Math.round(s * 32767);
      if (this.n === BLOCK) this.post();
    }
    post() {
      if (!this.n) return;
      const block = this.out.slice(0, this.n);
      this.port.postMessage(block, [block.buffer]);
      this.n = 0;
    }
    push(x) {
      if (this.pass) { for (let i = 0; i < x.length; i++) this.emit(x[i]); return; }
      const b = new Float32Array(this.buf.length + x.length);
      b.set(this.buf); b.set(x, this.buf.length); this.buf = b;
      while (this.t + this.half < this.buf.length) { this.emit(this.at(this.t)); this.t += this.step; }
      const drop = Math.floor(this.t - this.half);
      if (drop > 0) { this.buf = this.buf.slice(drop); this.t -= drop; }
    }
    flush() {
      if (!this.pass) {
        while (this.t < this.buf.length) { this.emit(this.at(this.t)); this.t += this.step; }
        this.buf = new Float32Array(0); this.t = 0;
      }
      this.post();
      this.port.postMessage("flushed");
    }
    process(inputs) {
      const input = inputs[0];
      if (input && input.length) this.push(input[0]);   // the node is mono: the graph downmixes
      return true;
    }
  }
  registerProcessor("pcm24k", Pcm24k);
  `;

  // --- state --------------------------------------------------------------------------------------------
  const live = {
    ws: null, ctx: null, stream: null, node: null,
    ready: false,            // session.updated seen: appends may go out
    queue: [],               // blocks captured before the session was ready
    manual: false,
    items: new Map(),        // item_id -> {el, text, state}
    openTurn: null,          // item_id between speech_started and speech_stopped
    awaitingCommit: 0,       // commits sent, not yet answered by committed (or an error)
    sinceCommit: 0,          // samples appended since the last commit (manual mode)
    stopping: false,
    lastError: null,         // the last error event's text (a refusal explains the close that follows)
    flushed: null,           // resolves when the worklet has flushed
  };
  const debug = {            // read by tests and handy in the console
    sentSamples: 0, recording: params.get("record") === "1" ? [] : null, events: [], state: "idle",
  };
  window.glmasr = debug;

  function setStatus(text, error = false) {
    const s = $("status");
    s.textContent = text;
    s.classList.toggle("error", error);
  }

  function apiKey() { return $("api-key").value.trim(); }

  function authHeaders() {
    const k = apiKey();
    return k ? { Authorization: "Bearer " + k } : {};
  }

  // --- transcript items ---------------------------------------------------------------------------------
  function item(id) {
    let it = live.items.get(id);
    if (!it) {
      const el = document.createElement("p");
      el.className = "item";
      el.dataset.itemId = id;
      el.dataset.state = "speaking";
      $("final").appendChild(el);
      it = { el, text: "", state: "speaking" };
      live.items.set(id, it);
    }
    return it;
  }

  function render(it) {
    it.el.dataset.state = it.state;
    it.el.textContent = it.text;
  }

  function place(id, previous) {
    // Items are chained by previous_item_id: put this one right after its predecessor when that is shown.
    const it = item(id);
    const prev = previous && live.items.get(previous);
    if (prev && prev.el.nextSibling !== it.el) prev.el.after(it.el);
  }

  function unfinished() {
    for (const it of live.items.values()) if (it.state !== "done" && it.state !== "failed") return true;
    return live.awaitingCommit > 0;
  }

  // --- the WebSocket session ----------------------------------------------------------------------------
  function send(obj) {
    const text = JSON.stringify(obj);
    if (debug.recording) debug.recording.push(text);
    live.ws.send(text);
  }

  function sessionUpdate() {
    const transcription = {};               // the session's model: the server's default
    const lang = $("language").value.trim();
    if (lang) transcription.language = lang;
    if ($("partials").checked) transcription[PARTIALS_FIELD] = true;
    const turn = live.manual ? null
      : { type: "server_vad", threshold: 0.5, prefix_padding_ms: 300, silence_duration_ms: 500 };
    return {
      type: "session.update",
      session: {
        type: "transcription",
        audio: { input: { format: { type: "audio/pcm", rate: OUT_RATE }, transcription, turn_detection: turn } },
      },
    };
  }

  function b64(int16) {
    const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
    let s = "";
    for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    return btoa(s);
  }

  function sendAudio(block) {
    send({ type: "input_audio_buffer.append", audio: b64(block) });
    debug.sentSamples += block.length;
    live.sinceCommit += block.length;
  }

  function onAudio(e) {
    if (e.data === "flushed") { if (live.flushed) live.flushed(); return; }
    const block = e.data;
    let peak = 0;
    for (let i = 0; i < block.length; i++) peak = Math.max(peak, Math.abs(block[i]));
    $("level").value = peak / 32768;
    if (live.ready) sendAudio(block); else live.queue.push(block);
  }

  function commit() {
    send({ type: "input_audio_buffer.commit" });
    live.awaitingCommit++;
    live.sinceCommit = 0;
  }

  function onEvent(ev) {
    debug.events.push(ev.type);
    const id = ev.item_id;
    switch (ev.type) {
      case "session.created":
        setStatus("Connected; setting up the session…");
        break;
      case "session.updated":
        if (!live.ready) {
          live.ready = true;
          for (const b of live.queue) sendAudio(b);
          live.queue = [];
          setStatus(live.manual ? "Listening. Press \"End turn\" when you finish a sentence." : "Listening…");
          debug.state = "listening";
        }
        break;
      case "input_audio_buffer.speech_started":
        live.openTurn = id;
        render(item(id));
        setStatus("Hearing speech…");
        break;
      case "input_audio_buffer.speech_stopped": {
        if (live.openTurn === id) live.openTurn = null;
        const it = item(id);
        if (it.state === "speaking") it.state = "transcribing";
        render(it);
        if (!live.stopping) setStatus("Listening…");
        break;
      }
      case "input_audio_buffer.committed": {
        live.awaitingCommit = Math.max(0, live.awaitingCommit - 1);
        place(id, ev.previous_item_id);
        const it = item(id);
        if (it.state === "speaking") it.state = "transcribing";
        render(it);
        break;
      }
      case "conversation.item.input_audio_transcription.delta": {
        const it = item(id);
        if (it.state === "done") break;
        it.text += ev.delta || "";
        if (it.state === "speaking" && live.openTurn !== id) it.state = "transcribing";
        render(it);
        break;
      }
      case "conversation.item.input_audio_transcription.completed": {
        const it = item(id);
        it.text = ev.transcript || "";
        it.state = "done";
        render(it);
        break;
      }
      case "conversation.item.input_audio_transcription.failed": {
        const it = item(id);
        it.state = "failed";
        it.text = "[transcription failed: " + ((ev.error && ev.error.message) || "unknown error") + "]";
        render(it);
        break;
      }
      case "error": {
        const err = ev.error || {};
        if (live.stopping && live.awaitingCommit > 0 && /commit|empty/i.test(err.code || "")) {
          // a commit at stop raced the server's own end of the turn: nothing was left to commit
          live.awaitingCommit--;
          for (const it of live.items.values()) if (it.state === "speaking") { it.el.remove(); it.state = "done"; }
          break;
        }
        live.lastError = "Server error: " + (err.message || err.code || "unknown")
          + (err.param ? " (" + err.param + ")" : "");
        setStatus(live.lastError, true);
        break;
      }
      default:
        break;
    }
    if (live.stopping && !unfinished()) finish();
  }

  function openSocket() {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const protocols = ["realtime"];
    const k = apiKey();
    if (k) protocols.push("openai-insecure-api-key." + k);
    const ws = new WebSocket(`${proto}//${location.host}/v1/realtime?intent=transcription`, protocols);
    live.ws = ws;
    let opened = false;
    ws.onopen = () => { opened = true; send(sessionUpdate()); };
    ws.onmessage = (e) => {
      let ev;
      try { ev = JSON.parse(e.data); } catch { return; }
      onEvent(ev);
    };
    ws.onclose = (e) => {
      if (live.ws !== ws) return;
      live.ws = null;
      const wasLive = debug.state === "listening" || debug.state === "connecting";
      teardownAudio();
      // a refused session says why in an error event before the close: keep that message
      if (!opened) setStatus("Could not open the live connection: is the server running?", true);
      else if (live.lastError && wasLive) setStatus(live.lastError + ` (connection closed, ${e.code})`, true);
      else if (e.code === 1013) setStatus("The server is busy (too many live sessions); try again later.", true);
      else if (live.stopping) setStatus("Stopped; the connection closed before every turn was transcribed.", true);
      else if (wasLive) setStatus(`The connection closed (${e.code}${e.reason ? ": " + e.reason : ""}).`, true);
      live.stopping = false;
      resetButtons();
      debug.state = "idle";
    };
  }

  // --- microphone ---------------------------------------------------------------------------------------
  async function start() {
    if (!navigator.mediaDevices || !window.AudioWorkletNode) {
      setStatus("This browser cannot capture audio here (it needs https or localhost, and AudioWorklet).", true);
      return;
    }
    localStorage.setItem(KEY_STORE, apiKey());
    live.manual = $("turns").value === "manual";
    live.ready = false; live.queue = []; live.stopping = false; live.openTurn = null;
    live.awaitingCommit = 0; live.sinceCommit = 0; live.lastError = null;
    debug.state = "connecting";
    $("mic").setAttribute("aria-pressed", "true");
    $("mic").textContent = "Stop microphone";
    for (const el of [$("turns"), $("partials"), $("language"), $("api-key")]) el.disabled = true;
    setStatus("Asking for the microphone…");
    $("mic").disabled = true;               // until the audio graph stands (stop needs it)
    try {
      // the raw microphone: the browser's echo cancellation, noise suppression and gain control are tuned for
      // calls and reshape speech in ways the recognizer was not trained on
      live.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
      });
      const ctx = new AudioContext();
      live.ctx = ctx;
      debug.rate = ctx.sampleRate;
      const url = URL.createObjectURL(new Blob([WORKLET], { type: "application/javascript" }));
      try { await ctx.audioWorklet.addModule(url); } finally { URL.revokeObjectURL(url); }
      const src = ctx.createMediaStreamSource(live.stream);
      const node = new AudioWorkletNode(ctx, "pcm24k",
        { numberOfInputs: 1, numberOfOutputs: 1, channelCount: 1, channelCountMode: "explicit" });
      node.port.onmessage = onAudio;
      live.node = node;
      const mute = ctx.createGain();            // a silent path to the destination keeps the node pulled
      mute.gain.value = 0;
      src.connect(node); node.connect(mute); mute.connect(ctx.destination);
      if (ctx.state === "suspended") await ctx.resume();
    } catch (e) {
      teardownAudio();
      resetButtons();
      debug.state = "idle";
      setStatus("No microphone: " + (e && e.message ? e.message : e), true);
      return;
    }
    $("mic").disabled = false;
    $("commit").disabled = !live.manual;
    setStatus("Connecting…");
    try {
      openSocket();
    } catch (e) {                            // e.g. a key with characters a subprotocol cannot carry
      teardownAudio();
      resetButtons();
      debug.state = "idle";
      setStatus("Could not open the live connection: " + (e && e.message ? e.message : e), true);
    }
  }

  async function flushWorklet() {
    if (!live.node) return;
    const done = new Promise((resolve) => { live.flushed = resolve; });
    live.node.port.postMessage("flush");
    await Promise.race([done, new Promise((r) => setTimeout(r, 1000))]);
    live.flushed = null;
  }

  async function stop() {
    if (live.stopping) return;
    live.stopping = true;
    $("mic").disabled = true;
    $("commit").disabled = true;
    setStatus("Finishing…");
    await flushWorklet();
    if (live.node) live.node.port.onmessage = null;   // nothing captured after the flush goes out
    teardownAudio();
    if (live.ws && live.ready && live.ws.readyState === WebSocket.OPEN) {
      // what was said last becomes a turn too: the open one (server VAD) or everything since the last commit
      if (live.manual ? live.sinceCommit > 0 : live.openTurn !== null) commit();
      if (unfinished()) {
        setTimeout(() => { if (live.stopping) finish(); }, DRAIN_TIMEOUT_MS);
        return;
      }
    }
    finish();
  }

  function finish() {
    if (!live.stopping) return;
    live.stopping = false;
    const ws = live.ws;
    live.ws = null;
    if (ws && ws.readyState <= WebSocket.OPEN) ws.close(1000, "done");
    teardownAudio();
    resetButtons();
    debug.state = "stopped";
    setStatus("Stopped.");
  }

  function teardownAudio() {
    if (live.stream) for (const t of live.stream.getTracks()) t.stop();
    if (live.ctx) live.ctx.close().catch(() => {});
    live.stream = null; live.ctx = null; live.node = null;
    $("level").value = 0;
  }

  function resetButtons() {
    $("mic").disabled = false;
    $("mic").setAttribute("aria-pressed", "false");
    $("mic").textContent = "Start microphone";
    $("commit").disabled = true;
    for (const el of [$("turns"), $("partials"), $("language"), $("api-key")]) el.disabled = false;
  }

  async function endTurn() {
    if (!live.ws || !live.ready) return;
    await flushWorklet();
    if (live.sinceCommit > 0) commit();
  }

  // --- file upload --------------------------------------------------------------------------------------
  async function modelName() {
    try {
      const r = await fetch("/v1/models", { headers: authHeaders() });
      if (r.ok) {
        const body = await r.json();
        if (body.data && body.data.length) return body.data[0].id;
      }
    } catch { /* the upload below reports the problem */ }
    return DEFAULT_MODEL;
  }

  async function upload(file) {
    const status = $("file-status");
    status.classList.remove("error");
    $("upload-text").textContent = "";
    $("upload-text").dataset.state = "busy";
    status.textContent = `Transcribing ${file.name}…`;
    localStorage.setItem(KEY_STORE, apiKey());
    const form = new FormData();
    form.append("file", file, file.name);
    form.append("model", await modelName());
    form.append("response_format", "json");
    const lang = $("language").value.trim();
    if (lang) form.append("language", lang);
    try {
      const t0 = performance.now();
      const r = await fetch("/v1/audio/transcriptions", { method: "POST", headers: authHeaders(), body: form });
      const body = await r.json().catch(() => null);
      if (!r.ok) {
        const msg = body && body.error ? body.error.message : `HTTP ${r.status}`;
        throw new Error(msg);
      }
      $("upload-text").textContent = body.text;
      $("upload-text").dataset.state = "done";
      status.textContent = `${file.name}: done in ${((performance.now() - t0) / 1000).toFixed(1)} s.`;
    } catch (e) {
      $("upload-text").dataset.state = "failed";
      status.textContent = `${file.name}: ${e.message || e}`;
      status.classList.add("error");
    }
  }

  // --- wiring -------------------------------------------------------------------------------------------
  function init() {
    $("api-key").value = localStorage.getItem(KEY_STORE) || "";
    $("api-key").addEventListener("change", () => localStorage.setItem(KEY_STORE, apiKey()));
    if (params.get("vad") === "0") $("turns").value = "manual";
    if (params.get("partials") === "1") $("partials").checked = true;
    if (params.get("language")) $("language").value = params.get("language");
    $("mic").addEventListener("click", () => (live.ws || live.ctx ? stop() : start()));
    $("commit").addEventListener("click", endTurn);
    $("clear").addEventListener("click", () => {
      for (const [id, it] of live.items) if (it.state === "done" || it.state === "failed") {
        it.el.remove(); live.items.delete(id);
      }
    });
    $("file").addEventListener("change", (e) => { if (e.target.files.length) upload(e.target.files[0]); });
    const drop = $("drop");
    drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
    drop.addEventListener("dragleave", () => drop.classList.remove("over"));
    drop.addEventListener("drop", (e) => {
      e.preventDefault();
      drop.classList.remove("over");
      if (e.dataTransfer.files.length) upload(e.dataTransfer.files[0]);
    });
  }

  init();
})();
