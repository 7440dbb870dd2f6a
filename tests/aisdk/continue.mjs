#!/usr/bin/env node
// A disconnect and an exact resume through useChat's own code path (AbstractChat + DefaultChatTransport,
// without React), against a live relay:
//   1. sendMessage: the transport's fetch GETs URL and passes its body through, then breaks the connection
//      the way fetch reports it (TypeError "network error") after CUT complete SSE events plus half of the
//      next one's bytes, so the cut falls inside an event;
//   2. resumeStream, with resumeStreamIsReplay: false: the chat kept the message it was building, and the
//      reconnect GETs URL&after=<id of the last complete event>, whose chunks continue that message.
//
// Usage: node continue.mjs --url URL --cut N [--ai-dir DIR]
// Output: one JSON object {aiVersion, lastId, requests, status, error, onFinish, assistantMessages}.
import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

function usage(msg) {
  process.stderr.write(`continue.mjs: ${msg}\n`);
  process.exit(2);
}

const opts = { url: undefined, cut: undefined, aiDir: process.env.AI_SDK_DIR };
for (let i = 2; i < process.argv.length; i++) {
  const a = process.argv[i];
  const next = () => process.argv[++i] ?? usage(`${a} needs a value`);
  if (a === '--url') opts.url = next();
  else if (a === '--cut') opts.cut = Number(next());
  else if (a === '--ai-dir') opts.aiDir = next();
  else usage(`unknown argument ${a}`);
}
if (!opts.url || !(opts.cut >= 1)) usage('--url and --cut N (N >= 1) are required');

const base = opts.aiDir ? path.resolve(opts.aiDir) : path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(base, 'noop.js'));
const pkgJson = require.resolve('ai/package.json');
const pkg = JSON.parse(await readFile(pkgJson, 'utf8'));
const ai = await import(pathToFileURL(path.join(path.dirname(pkgJson), pkg.exports['.'].import)).href);

const encoder = new TextEncoder();
let lastId = null;
const requests = [];

// The first response: complete events up to the cut, half an event, then a network error.
async function cutResponse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let text = '';
  const events = [];
  while (events.length <= opts.cut) {
    const { value, done } = await reader.read();
    if (done) break;
    text += decoder.decode(value, { stream: true });
    let end;
    while ((end = text.indexOf('\n\n')) !== -1) {
      events.push(text.slice(0, end + 2));
      text = text.slice(end + 2);
    }
  }
  await reader.cancel();
  if (events.length <= opts.cut) usage(`the stream had only ${events.length} events, fewer than --cut + 1`);
  const kept = events.slice(0, opts.cut);
  for (const ev of kept) {
    const m = /^id: (.*)$/m.exec(ev);
    if (m) lastId = m[1];
  }
  const next = events[opts.cut];
  const body = new ReadableStream({
    start(controller) {
      controller.enqueue(encoder.encode(kept.join('') + next.slice(0, Math.floor(next.length / 2))));
      setTimeout(() => controller.error(new TypeError('network error')), 0);
    },
  });
  return new Response(body, { status: 200, headers: response.headers });
}

const transport = new ai.DefaultChatTransport({
  api: 'http://harness.invalid/api/chat',
  resumeStreamIsReplay: false,
  prepareReconnectToStreamRequest: () => ({ api: `${opts.url}&after=${encodeURIComponent(lastId)}` }),
  fetch: async (url, init) => {
    const target = requests.length === 0 ? opts.url : String(url);
    requests.push({ method: init?.method ?? 'GET', url: target });
    const response = await fetch(target, { headers: init?.headers });
    return requests.length === 1 ? cutResponse(response) : response;
  },
});

const state = {
  status: 'ready', error: undefined, messages: [],
  pushMessage(m) { this.messages = this.messages.concat(m); },
  popMessage() { this.messages = this.messages.slice(0, -1); },
  replaceMessage(i, m) { this.messages = [...this.messages.slice(0, i), m, ...this.messages.slice(i + 1)]; },
  snapshot: (t) => structuredClone(t),
};
let onFinish = null;
const errors = [];
class HarnessChat extends ai.AbstractChat {}
let n = 0;
const chat = new HarnessChat({
  id: 'harness-chat', generateId: () => `harness-${++n}`, transport, state,
  onError: (e) => errors.push(String(e?.message ?? e)),
  onFinish: ({ isAbort, isDisconnect, isError, finishReason }) => { onFinish = { isAbort, isDisconnect, isError, finishReason: finishReason ?? null }; },
});

await chat.sendMessage({ text: 'harness' });
const afterCut = { status: chat.status, onFinish, errors: [...errors] };
await chat.resumeStream();
process.stdout.write(JSON.stringify({
  aiVersion: pkg.version, lastId, requests, afterCut, status: chat.status, error: chat.error ? String(chat.error.message) : null,
  errors, onFinish, assistantMessages: state.messages.filter((m) => m.role === 'assistant'),
}, null, 2) + '\n');
