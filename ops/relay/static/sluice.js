// sluice.js: the relay's browser client. An ES module with no build step and no dependencies:
//   import { follow, RequestView, RelaySocket, openSession } from "https://relay.example/static/sluice.js";
//
// It assembles sluice's contract (README "The contract") the way the Python client does: blocks in index
// order with their text, tool name, call id, argument text and parsed arguments; one entry per attempt
// (each attempt is its own stream, never spliced: a retried attempt's blocks are not the answer's); the
// terminal with stop reason, usage or error; positions, so a reconnect resumes exactly after the last event
// it applied. `follow` reads the SSE endpoint with fetch (so it sees HTTP statuses, sends the token in a
// header, and retries after a 503's Retry-After); `RelaySocket` follows many requests over one WebSocket.
"use strict";

export const VERSION = "1";

// ---- positions --------------------------------------------------------------------------------------------

/** "<attempt>-<seq>" as [attempt, seq]; null for anything else. */
export function parsePosition(text) {
  const m = /^(\d+)-(\d+)$/.exec(text ?? "");
  return m ? [Number(m[1]), Number(m[2])] : null;
}

/** -1, 0 or 1, like the relay orders positions (attempt first). */
export function comparePositions(a, b) {
  const pa = parsePosition(a) ?? [0, 0];
  const pb = parsePosition(b) ?? [0, 0];
  return Math.sign(pa[0] - pb[0] || pa[1] - pb[1]);
}

// ---- Server-Sent Events (WHATWG HTML 9.2.6), fed with decoded text -----------------------------------------

export class SSEParser {
  constructor() {
    this.buffer = "";
    this.data = [];
    this.event = "";
    this.id = undefined;
    this.lastId = "";
    this.retry = null;
  }

  /** Feed text; returns the events it completed: {event, data, id}. */
  feed(text) {
    this.buffer += text;
    const out = [];
    let start = 0;
    for (;;) {
      const m = /\r\n|\r|\n/g;
      m.lastIndex = start;
      const hit = m.exec(this.buffer);
      // A CR at the very end may be the first half of a CRLF: wait for the next chunk.
      if (!hit || (hit[0] === "\r" && hit.index === this.buffer.length - 1)) break;
      const line = this.buffer.slice(start, hit.index);
      start = hit.index + hit[0].length;
      if (line === "") {
        if (this.id !== undefined) this.lastId = this.id;
        if (this.data.length) out.push({ event: this.event || "message", data: this.data.join("\n"), id: this.lastId });
        this.data = [];
        this.event = "";
        this.id = undefined;
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon === -1 ? line : line.slice(0, colon);
      let value = colon === -1 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") this.data.push(value);
      else if (field === "event") this.event = value;
      else if (field === "id" && !value.includes("\0")) this.id = value;
      else if (field === "retry" && /^\d+$/.test(value)) this.retry = Number(value);
    }
    this.buffer = this.buffer.slice(start);
    return out;
  }
}

// ---- the contract, assembled -------------------------------------------------------------------------------

function newAttempt(data) {
  return {
    attempt: data.attempt, provider: data.provider ?? null, model: data.model ?? null, blocks: [],
    status: "streaming", stopReason: null, providerStopReason: null, usage: null, error: null, warnings: [],
  };
}

/** One request as the relay streams it. `apply` takes events in order and ignores any it already has. */
export class RequestView {
  constructor(requestId) {
    this.requestId = requestId;
    this.attempts = [];
    this.lastId = null; // the position of the last event applied: resume after it
    this.finalId = null; // set by the relay's `end`: the request is over
    this.ended = false;
    this.positions = [];
  }

  get current() {
    return this.attempts.length ? this.attempts[this.attempts.length - 1] : null;
  }

  /** The current attempt's blocks (earlier attempts failed before showing anything, and were retried). */
  get blocks() {
    return this.current ? this.current.blocks : [];
  }

  get status() {
    return this.current ? this.current.status : "waiting";
  }

  /** Apply one event (`type` is the SSE event name, `data` its parsed JSON, `id` its position). Returns
   * false when it was a duplicate (at or before the last position applied). */
  apply(type, data, id) {
    if (type === "end") {
      this.finalId = data?.final ?? null;
      this.ended = true;
      return true;
    }
    if (id) {
      if (this.lastId !== null && comparePositions(id, this.lastId) <= 0) return false;
      this.lastId = id;
      this.positions.push(id);
    }
    if (type === "stream.start") {
      this.attempts.push(newAttempt(data));
      return true;
    }
    if (!this.current) this.attempts.push(newAttempt({ attempt: parsePosition(id)?.[0] ?? 1 }));
    const attempt = this.current;
    const b = data.block;
    const find = (index) => attempt.blocks.find((x) => x.index === index);
    switch (type) {
      case "block.start":
      case "block.withheld": {
        const withheld = type === "block.withheld";
        attempt.blocks.push({
          index: b.index, id: b.id, kind: b.kind, name: b.name ?? null, callId: b.call_id ?? null,
          visibility: b.visibility ?? null, text: "", signature: "", argumentsText: "", arguments: null,
          argumentsError: null, state: withheld ? "withheld" : "streaming", withheld,
        });
        attempt.blocks.sort((x, y) => x.index - y.index);
        break;
      }
      case "block.delta": {
        const block = find(b.index);
        if (!block || block.withheld) break;
        if (data.delta.kind === "signature") block.signature += data.delta.text;
        else if (data.delta.kind === "json_text") block.argumentsText += data.delta.text;
        else block.text += data.delta.text;
        break;
      }
      case "block.stop": {
        const block = find(b.index);
        if (!block || block.withheld) break;
        block.state = "complete";
        if (block.kind === "tool_call") {
          block.arguments = data.arguments ?? null;
          block.argumentsError = data.arguments_error ?? null;
        }
        break;
      }
      case "stream.warning":
        attempt.warnings.push({ code: data.code, message: data.message, count: data.count ?? 1 });
        break;
      case "stream.done":
        Object.assign(attempt, {
          status: data.status ?? "completed", stopReason: data.stop_reason ?? null,
          providerStopReason: data.provider_stop_reason ?? null, usage: data.usage ?? null,
        });
        break;
      case "stream.error":
        Object.assign(attempt, { status: data.status, error: data.error, usage: data.usage ?? null });
        // Blocks the failure cut: what arrived stays, marked as not complete (never passed off as done).
        for (const block of attempt.blocks) if (block.state === "streaming") block.state = "incomplete";
        break;
      default:
        break; // anything newer than this client: ignored
    }
    return true;
  }
}

// ---- following one request over SSE ------------------------------------------------------------------------

export class RelayError extends Error {
  constructor(status, message, retryAfterMs = null) {
    super(message);
    this.name = "RelayError";
    this.status = status;
    this.retryAfterMs = retryAfterMs;
  }
}

const REASONS = {
  400: "the request was malformed",
  401: "no access: a token is needed",
  403: "access refused: the token is not valid for this request (or has expired)",
  404: "no such request",
  500: "the relay failed",
};

function jitter(ms) {
  return ms + Math.random() * Math.min(1000, ms / 2);
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

async function errorMessage(response) {
  try {
    const text = await response.text();
    try {
      return JSON.parse(text).error ?? text;
    } catch {
      const m = /^data: (.*)$/m.exec(text);
      return m ? JSON.parse(m[1]).error ?? text : text;
    }
  } catch {
    return "";
  }
}

/**
 * Follow a request until its final event, reconnecting as needed. Options:
 *   base        the relay's URL ("" for the page's own origin)
 *   token       sent as `Authorization: Bearer` (never in the URL), and then no cookie: the relay refuses
 *               a request carrying more than one credential (400 invalid_request)
 *   getToken    async () => a fresh token; called on 401/403 (once per refusal) to refresh access
 *   credentials fetch's credentials mode without a token ("same-origin"; "include" to send a session
 *               cookie cross-origin)
 *   after       resume after this position
 *   coalesceMs  ask the relay to merge small text deltas
 *   view        a RequestView to continue (default: a new one)
 *   onEvent(view, type, data)   after each event applied
 *   onState(state, detail)      "connecting" | "streaming" | "reconnecting" | "done" | "closed"
 * Returns {view, done, close}: `done` resolves to {state, status?, reason?} when the request is over
 * ("done") or the relay refused it for good ("closed", with the HTTP status and the relay's reason).
 */
export function follow(requestId, options = {}) {
  const view = options.view ?? new RequestView(requestId);
  const controller = new AbortController();
  const base = options.base ?? "";
  let token = options.token ?? null;
  const setState = (state, detail = {}) => options.onState?.(state, detail);

  async function run() {
    let failures = 0;
    let first = true;
    let refreshed = false;
    let retryMs = 1000;
    for (;;) {
      if (controller.signal.aborted) return { state: "closed", reason: "closed by the page" };
      const query = new URLSearchParams();
      const after = view.lastId ?? options.after;
      if (after) query.set("after", after);
      if (options.coalesceMs) query.set("coalesce_ms", String(options.coalesceMs));
      const headers = { accept: "text/event-stream" };
      if (token) headers.authorization = `Bearer ${token}`;
      if (first) setState("connecting");  // later rounds said "reconnecting" (and why) before waiting
      first = false;
      let response;
      try {
        response = await fetch(`${base}/v1/requests/${encodeURIComponent(requestId)}/events?${query}`, {
          headers, credentials: token ? "omit" : (options.credentials ?? "same-origin"), cache: "no-store",
          signal: controller.signal,
        });
      } catch (err) {
        if (controller.signal.aborted) return { state: "closed", reason: "closed by the page" };
        failures += 1;
        setState("reconnecting", { reason: "network error", attempt: failures });
        await sleep(jitter(Math.min(30000, 500 * 2 ** failures)), controller.signal);
        continue;
      }
      if (response.status === 204) return { state: "done", status: 204 };
      if (response.status === 503) {
        const seconds = Number(response.headers.get("retry-after"));
        const reason = await errorMessage(response);
        failures += 1;
        setState("reconnecting", { status: 503, reason, attempt: failures });
        await sleep(jitter(Number.isFinite(seconds) && seconds > 0 ? seconds * 1000 : 2000), controller.signal);
        continue;
      }
      if ((response.status === 401 || response.status === 403) && options.getToken && !refreshed) {
        refreshed = true;
        token = await options.getToken();
        continue;
      }
      if (response.status !== 200) {
        const reason = (await errorMessage(response)) || REASONS[response.status] || `HTTP ${response.status}`;
        return { state: "closed", status: response.status, reason };
      }
      refreshed = false;
      failures = 0;
      setState("streaming");
      const parser = new SSEParser();
      const decoder = new TextDecoder();
      const reader = response.body.getReader();
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          for (const ev of parser.feed(decoder.decode(value, { stream: true }))) {
            const data = JSON.parse(ev.data);
            if (view.apply(ev.event, data, ev.id || null)) options.onEvent?.(view, ev.event, data);
          }
          if (parser.retry !== null) retryMs = parser.retry;
        }
      } catch (err) {
        if (controller.signal.aborted) return { state: "closed", reason: "closed by the page" };
      }
      if (view.ended) return { state: "done", status: 200 };
      // The stream ended before the request did (a relay restart, a proxy timeout): resume after lastId.
      setState("reconnecting", { reason: "the stream ended early" });
      await sleep(jitter(retryMs), controller.signal);
    }
  }

  const done = run().then((outcome) => {
    setState(outcome.state, outcome);
    return outcome;
  });
  return { view, done, close: () => controller.abort() };
}

/** Trade a (short-lived) token for an HttpOnly session cookie scoped to this request's endpoints, so
 * reconnects need no token at all. Resolves to {request_id, expires_at}; throws RelayError. */
export async function openSession(requestId, token, { base = "", credentials = "same-origin" } = {}) {
  const response = await fetch(`${base}/v1/requests/${encodeURIComponent(requestId)}/session`, {
    method: "POST", headers: { authorization: `Bearer ${token}` }, credentials, cache: "no-store",
  });
  if (!response.ok) throw new RelayError(response.status, await errorMessage(response));
  return response.json();
}

// ---- many requests over one WebSocket ----------------------------------------------------------------------

/**
 * Follow many requests over one WebSocket (`/v1/ws`). `url` is the relay's ws(s):// URL of that path.
 * Options: getToken(requestId) => a token for a request (called when (re)subscribing without a valid
 * one), WebSocket (an implementation, default the browser's). Subscriptions survive reconnects: each
 * resumes after the last position it applied.
 */
export class RelaySocket {
  constructor(url, options = {}) {
    this.url = url;
    this.options = options;
    this.subs = new Map(); // request id -> {view, options, state}
    this.tokens = new Map(); // request id (or "*") -> token
    this.waiters = [];
    this.closed = false;
    this.reconnects = 0;
    this.ready = this._connect();
    this.ready.catch(() => {}); // a failed first connection is retried by the close handler
  }

  _connect() {
    const Impl = this.options.WebSocket ?? WebSocket;
    const ws = (this.ws = new Impl(this.url));
    return new Promise((resolve, reject) => {
      ws.onopen = () => {
        for (const token of new Set(this.tokens.values())) this._send({ type: "auth", token });
        for (const [rid, sub] of this.subs) this._subscribeWire(rid, sub);
        resolve();
      };
      ws.onmessage = (m) => this._message(JSON.parse(m.data));
      ws.onerror = () => reject(new Error("WebSocket error"));
      ws.onclose = (e) => {
        this.lastClose = { code: e.code, reason: e.reason };
        if (this.closed || e.code === 1008) return;
        this.reconnects += 1;
        // 1012: the relay restarts; anything else: a network blip. Come back with a jittered delay.
        setTimeout(() => {
          if (this.closed) return;
          this.ready = this._connect();
          this.ready.catch(() => {});
        }, jitter(e.code === 1012 ? 500 : 1000));
      };
    });
  }

  _send(doc) {
    if (this.ws.readyState === 1) this.ws.send(JSON.stringify(doc));
  }

  /** Remember a token (for its request, or every request for a deployment secret) and send it. */
  async auth(token) {
    await this.ready;
    const ack = this._wait((m) => m.event === "auth");
    this._send({ type: "auth", token });
    const reply = await ack;
    if (reply.data.ok) this.tokens.set(reply.data.request_id ?? "*", token);
    return reply.data;
  }

  /** Follow a request; options: after, coalesceMs, token, onEvent(view, type, data), onEnd(view),
   * onError(status, reason). Returns {view, unsubscribe}. */
  subscribe(requestId, options = {}) {
    const sub = { view: options.view ?? new RequestView(requestId), options, state: "subscribing" };
    if (options.token) this.tokens.set(requestId, options.token);
    this.subs.set(requestId, sub);
    // An open socket subscribes now; otherwise its `open` handler subscribes everything in `subs`.
    if (this.ws.readyState === 1) this._subscribeWire(requestId, sub);
    return { view: sub.view, unsubscribe: () => this.unsubscribe(requestId) };
  }

  unsubscribe(requestId) {
    this.subs.delete(requestId);
    this._send({ type: "unsubscribe", request_id: requestId });
  }

  _subscribeWire(requestId, sub) {
    const doc = { type: "subscribe", request_id: requestId };
    const after = sub.view.lastId ?? sub.options.after;
    if (after) doc.after = after;
    if (sub.options.coalesceMs) doc.coalesce_ms = sub.options.coalesceMs;
    const token = this.tokens.get(requestId);
    if (token) doc.token = token;
    this._send(doc);
  }

  _wait(predicate) {
    return new Promise((resolve) => this.waiters.push({ predicate, resolve }));
  }

  _message(m) {
    this.waiters = this.waiters.filter((w) => (w.predicate(m) ? (w.resolve(m), false) : true));
    const sub = m.request_id !== undefined ? this.subs.get(m.request_id) : undefined;
    if (!sub) return;
    if (m.event === "subscribed") sub.state = "streaming";
    else if (m.event === "error") {
      sub.state = "closed";
      sub.error = m.data;
      const refresh = (m.data.status === 401 || m.data.status === 403) && this.options.getToken && !sub.refreshed;
      if (refresh) {
        sub.refreshed = true;
        Promise.resolve(this.options.getToken(m.request_id)).then((token) => {
          this.tokens.set(m.request_id, token);
          this._subscribeWire(m.request_id, sub);
        });
      } else if (m.data.status === 503) {
        setTimeout(() => this.subs.has(m.request_id) && this._subscribeWire(m.request_id, sub), jitter(m.data.retry_after_ms ?? 2000));
      } else {
        this.subs.delete(m.request_id);
        sub.options.onError?.(m.data.status, m.data.error);
      }
    } else if (m.event === "end") {
      sub.view.apply("end", m.data, null);
      sub.state = "done";
      this.subs.delete(m.request_id);
      sub.options.onEnd?.(sub.view);
    } else if (m.id !== undefined) {
      sub.refreshed = false;
      if (sub.view.apply(m.event, m.data, m.id)) sub.options.onEvent?.(sub.view, m.event, m.data);
    }
  }

  close() {
    this.closed = true;
    this.ws.close(1000);
  }
}
