#!/usr/bin/env node
// Validate a Vercel AI SDK "UI message stream" (SSE body) with the `ai` package's OWN code:
//   1. parseJsonEventStream + uiMessageChunkSchema  (exactly what DefaultChatTransport does)
//   2. readUIMessageStream                           (assembles the final UIMessage)
//   3. AbstractChat + DefaultChatTransport          (the code path useChat runs, minus React)
// plus a few framing checks the SDK does not enforce ([DONE] last, start first, a terminal chunk).
//
// Usage:
//   node check.mjs [FILE|-]            read the full SSE body from FILE (or stdin when omitted / "-")
//   node check.mjs --url URL           GET URL, also check status + headers, then validate the body
// Options:
//   --strict        framing warnings become errors (exit 1)
//   --resume        run the chat emulation through chat.resumeStream() (GET reconnect path)
//   --ai-dir DIR    use the `ai` installed under DIR/node_modules (default: $AI_SDK_DIR, else next to this file)
//   --timeout MS    for --url: abort after MS milliseconds (default 30000)
//   --no-chunks     omit the chunk list from the output
// Output: one JSON object on stdout:
//   {aiVersion, source, http?, chunks, errors, warnings, errorChunks, message, chat}
// Exit: 0 = valid, 1 = violation (errors non-empty), 2 = usage / IO problem.

import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

function usage(msg) {
  process.stderr.write(`check.mjs: ${msg}\n`);
  process.exit(2);
}

function parseArgs(argv) {
  const opts = { file: undefined, url: undefined, strict: false, resume: false, aiDir: process.env.AI_SDK_DIR || undefined, timeout: 30000, chunks: true };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const next = () => (i + 1 < argv.length ? argv[++i] : usage(`${a} needs a value`));
    if (a === '--strict') opts.strict = true;
    else if (a === '--resume') opts.resume = true;
    else if (a === '--no-chunks') opts.chunks = false;
    else if (a === '--url') opts.url = next();
    else if (a === '--ai-dir') opts.aiDir = next();
    else if (a === '--timeout') opts.timeout = Number(next());
    else if (a === '-h' || a === '--help') usage('see the header of check.mjs for usage');
    else if (a.startsWith('--')) usage(`unknown option ${a}`);
    else if (opts.file === undefined) opts.file = a;
    else usage(`unexpected argument ${a}`);
  }
  if (opts.url && opts.file) usage('give either FILE or --url, not both');
  return opts;
}

async function loadAi(aiDir) {
  const base = aiDir ? path.resolve(aiDir) : path.dirname(fileURLToPath(import.meta.url));
  const require = createRequire(path.join(base, 'noop.js'));
  const pkgJson = require.resolve('ai/package.json');
  const pkg = JSON.parse(await readFile(pkgJson, 'utf8'));
  // Import the ESM build of exactly that install.
  const esm = path.join(path.dirname(pkgJson), pkg.exports['.'].import);
  const ai = await import(pathToFileURL(esm).href);
  for (const name of ['parseJsonEventStream', 'uiMessageChunkSchema', 'readUIMessageStream', 'AbstractChat', 'DefaultChatTransport', 'UI_MESSAGE_STREAM_HEADERS']) {
    if (!(name in ai)) usage(`ai@${pkg.version} does not export ${name}`);
  }
  return { ai, version: pkg.version, path: path.dirname(pkgJson) };
}

async function readStdin() {
  const parts = [];
  for await (const c of process.stdin) parts.push(c);
  return Buffer.concat(parts);
}

function bytesStream(bytes) {
  return new ReadableStream({
    start(c) {
      c.enqueue(new Uint8Array(bytes));
      c.close();
    },
  });
}

function arrayStream(items) {
  return new ReadableStream({
    start(c) {
      for (const x of items) c.enqueue(x);
      c.close();
    },
  });
}

function errText(e, max = 600) {
  if (e == null) return String(e);
  const t = `${e.name ?? 'Error'}: ${e.message ?? String(e)}`;
  return t.length > max ? `${t.slice(0, max)}...` : t;
}

// The chunk schema is a union of ~25 objects, so zod reports every branch. Keep only the branches whose
// `type` matched (or all branches' non-`type` issues when the type itself is unknown): "path: message".
function schemaProblems(err) {
  const top = err?.cause?.issues;
  if (!Array.isArray(top)) return undefined;
  const out = [];
  for (const issue of top) {
    if (issue.code !== 'invalid_union' || !Array.isArray(issue.errors)) {
      out.push(`${issue.path?.join('.') || '(root)'}: ${issue.message}`);
      continue;
    }
    const matching = issue.errors.filter(branch => !branch.some(i => i.path?.length === 1 && i.path[0] === 'type'));
    if (matching.length === 0) out.push('type: not a known UI message chunk type');
    for (const branch of matching) for (const i of branch) out.push(`${i.path?.join('.') || '(root)'}: ${i.message}`);
  }
  return out;
}

// Minimal WHATWG-style SSE framing, only for the framing checks (the SDK's own parser is authoritative).
function sseFrame(text) {
  const lines = text.replace(/\r\n|\r/g, '\n').split('\n');
  const events = [];
  let data = [];
  let fields = {};
  let comments = 0;
  for (const line of lines) {
    if (line === '') {
      if (data.length) events.push({ data: data.join('\n'), ...fields });
      data = [];
      fields = {};
      continue;
    }
    if (line.startsWith(':')) { comments++; continue; }
    const colon = line.indexOf(':');
    const name = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (name === 'data') data.push(value);
    else fields[name] = value;
  }
  const unterminated = data.length > 0; // last event not followed by a blank line: never dispatched
  return { events, comments, unterminated, endsWithBlankLine: /\n\n$/.test(text.replace(/\r\n|\r/g, '\n')) };
}

function framingWarnings(frame, chunks) {
  const w = [];
  const { events } = frame;
  if (frame.unterminated) w.push('the last event is not terminated by a blank line; SSE parsers drop it');
  const doneIdx = events.findIndex(e => e.data === '[DONE]');
  if (doneIdx === -1) w.push('no `data: [DONE]` event');
  else if (doneIdx !== events.length - 1) w.push(`events after \`data: [DONE]\` (${events.length - 1 - doneIdx} of them)`);
  const named = events.filter(e => e.event !== undefined && e.event !== 'message');
  if (named.length) w.push(`${named.length} event(s) carry an \`event:\` name; the SDK ignores names and parses every data line as a chunk`);
  if (chunks.length === 0) {
    w.push('no chunks');
    return w;
  }
  if (chunks[0].type !== 'start') w.push(`first chunk is \`${chunks[0].type}\`, expected \`start\``);
  const starts = chunks.filter(c => c.type === 'start').length;
  if (starts > 1) w.push(`${starts} \`start\` chunks`);
  const last = chunks[chunks.length - 1].type;
  if (!['finish', 'abort', 'error'].includes(last)) w.push(`last chunk is \`${last}\`, expected \`finish\`, \`abort\` or \`error\``);
  const finishes = chunks.filter(c => c.type === 'finish').length;
  if (finishes > 1) w.push(`${finishes} \`finish\` chunks`);
  const firstError = chunks.findIndex(c => c.type === 'error');
  if (firstError !== -1) {
    const after = chunks.slice(firstError + 1).filter(c => !['finish-step', 'finish', 'abort'].includes(c.type));
    if (after.length) w.push(`${after.length} content chunk(s) after the first \`error\` chunk; useChat stops reading at an \`error\` chunk`);
  }
  // open/close balance per id (the assembler only checks that deltas/ends have a start)
  const open = new Map();
  let stepDepth = 0;
  for (const c of chunks) {
    const kind = c.type.split('-')[0];
    if (c.type === 'text-start' || c.type === 'reasoning-start') open.set(`${kind}:${c.id}`, c.type);
    if (c.type === 'text-end' || c.type === 'reasoning-end') open.delete(`${kind}:${c.id}`);
    if (c.type === 'tool-input-start') open.set(`tool:${c.toolCallId}`, c.type);
    if (['tool-input-available', 'tool-input-error'].includes(c.type)) open.delete(`tool:${c.toolCallId}`);
    if (c.type === 'start-step') {
      if (stepDepth > 0) w.push('`start-step` while a step is open');
      stepDepth = 1;
    }
    if (c.type === 'finish-step') {
      if (stepDepth === 0) w.push('`finish-step` without `start-step`');
      stepDepth = 0;
    }
  }
  // After `error`/`abort` the SDK's own streamText leaves parts open, so only flag this on clean endings.
  const interrupted = chunks.some(c => c.type === 'error' || c.type === 'abort');
  if (open.size && !interrupted) w.push(`never closed: ${[...open.entries()].map(([k, t]) => `${k} (${t})`).join(', ')}`);
  if (stepDepth && !interrupted) w.push('`start-step` without `finish-step`');
  return w;
}

async function parseChunks(ai, bytes) {
  const results = [];
  const stream = ai.parseJsonEventStream({ stream: bytesStream(bytes), schema: ai.uiMessageChunkSchema });
  for await (const r of stream) results.push(r);
  return results;
}

async function assemble(ai, chunks) {
  const errors = [];
  const errorChunks = [];
  let current; // last chunk handed to the assembler
  const tracked = arrayStream(chunks).pipeThrough(new TransformStream({
    transform(c, ctl) { current = c; ctl.enqueue(c); },
  }));
  let message;
  const onError = e => {
    // An `error` chunk reaches onError as `new Error(errorText)`; anything else is a protocol violation.
    if (current?.type === 'error' && e?.message === current.errorText && e?.name === 'Error') {
      errorChunks.push(current.errorText);
    } else {
      errors.push({ stage: 'assemble', chunkType: e?.chunkType ?? current?.type, error: errText(e) });
    }
  };
  for await (const m of ai.readUIMessageStream({ stream: tracked, onError })) message = m;
  return { message, errors, errorChunks };
}

async function emulateChat(ai, bytes, resume) {
  let n = 0;
  const generateId = () => `harness-${++n}`;
  const state = {
    status: 'ready',
    error: undefined,
    messages: [],
    pushMessage(m) { this.messages = this.messages.concat(m); },
    popMessage() { this.messages = this.messages.slice(0, -1); },
    replaceMessage(i, m) { this.messages = [...this.messages.slice(0, i), m, ...this.messages.slice(i + 1)]; },
    snapshot: t => structuredClone(t),
  };
  const requests = [];
  const transport = new ai.DefaultChatTransport({
    api: 'http://harness.invalid/api/chat',
    fetch: async (url, init) => {
      requests.push({ method: init?.method ?? 'GET', url: String(url) });
      return new Response(bytesStream(bytes), { status: 200, headers: ai.UI_MESSAGE_STREAM_HEADERS });
    },
  });
  let finish;
  const onErrorCalls = [];
  class HarnessChat extends ai.AbstractChat {}
  const chat = new HarnessChat({
    id: 'harness-chat',
    generateId,
    transport,
    state,
    onError: e => onErrorCalls.push(errText(e)),
    onFinish: ({ message, isAbort, isDisconnect, isError, finishReason }) => {
      finish = { isAbort, isDisconnect, isError, finishReason: finishReason ?? null, messageId: message?.id };
    },
  });
  if (resume) await chat.resumeStream();
  else await chat.sendMessage({ text: 'harness' });
  const assistant = state.messages.filter(m => m.role === 'assistant');
  return {
    mode: resume ? 'resumeStream' : 'sendMessage',
    requests,
    status: chat.status,
    error: chat.error ? errText(chat.error) : null,
    onError: onErrorCalls,
    onFinish: finish ?? null,
    assistantMessages: assistant,
  };
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const { ai, version } = await loadAi(opts.aiDir);
  const out = { aiVersion: version, source: opts.url ?? opts.file ?? '-', errors: [], warnings: [] };

  let bytes;
  try {
    if (opts.url) {
      const res = await fetch(opts.url, { signal: AbortSignal.timeout(opts.timeout) });
      const headers = Object.fromEntries(res.headers.entries());
      out.http = { status: res.status, headers };
      bytes = Buffer.from(await res.arrayBuffer());
      if (res.status !== 200) out.errors.push({ stage: 'http', error: `status ${res.status}` });
      if (headers['x-vercel-ai-ui-message-stream'] !== 'v1') out.errors.push({ stage: 'http', error: `x-vercel-ai-ui-message-stream is ${JSON.stringify(headers['x-vercel-ai-ui-message-stream'])}, expected "v1"` });
      if (!(headers['content-type'] ?? '').startsWith('text/event-stream')) out.errors.push({ stage: 'http', error: `content-type is ${JSON.stringify(headers['content-type'])}` });
    } else if (opts.file && opts.file !== '-') {
      bytes = await readFile(opts.file);
    } else {
      bytes = await readStdin();
    }
  } catch (e) {
    usage(`cannot read input: ${errText(e)}`);
  }

  // 1. the SDK's parser + schema
  const results = await parseChunks(ai, bytes);
  const chunks = [];
  let firstInvalid = -1;
  results.forEach((r, i) => {
    if (r.success) chunks.push(r.value);
    else {
      if (firstInvalid === -1) firstInvalid = i;
      out.errors.push({
        stage: 'parse',
        index: i,
        kind: r.error?.name === 'AI_JSONParseError' ? 'json' : 'schema',
        problems: schemaProblems(r.error),
        error: errText(r.error, 300),
        rawValue: r.rawValue,
      });
    }
  });
  // DefaultChatTransport throws at the first invalid chunk, so the client never sees what follows it.
  const seen = firstInvalid === -1 ? chunks : results.slice(0, firstInvalid).map(r => r.value);

  // 2. framing checks (not enforced by the SDK)
  const frame = sseFrame(new TextDecoder().decode(bytes));
  const dataEvents = frame.events.filter(e => e.data !== '[DONE]').length;
  if (dataEvents !== results.length) out.errors.push({ stage: 'frame', error: `own SSE framing found ${dataEvents} data events, the SDK parser ${results.length}` });
  const fw = framingWarnings(frame, chunks);
  if (opts.strict) out.errors.push(...fw.map(w => ({ stage: 'strict', error: w })));
  else out.warnings.push(...fw);

  // 3. readUIMessageStream
  const asm = await assemble(ai, seen);
  out.errors.push(...asm.errors);
  out.errorChunks = asm.errorChunks;
  if (opts.chunks) out.chunks = chunks;
  out.message = asm.message ?? null;

  // 4. useChat's code path
  try {
    out.chat = await emulateChat(ai, bytes, opts.resume);
  } catch (e) {
    out.errors.push({ stage: 'chat', error: errText(e) });
  }

  process.stdout.write(JSON.stringify(out, null, 2) + '\n');
  process.exitCode = out.errors.length ? 1 : 0;
}

main().catch(e => {
  process.stderr.write(`check.mjs: internal error: ${e?.stack ?? e}\n`);
  process.exit(2);
});
