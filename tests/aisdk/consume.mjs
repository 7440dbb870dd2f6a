#!/usr/bin/env node
// The consumer guide's recipes (docs/consumer-guide.md), written as a Node.js service would with
// node-redis and ajv: nothing of sluice's own code, only what the guide says.
//
// Usage: node consume.mjs --ai-dir DIR --url REDIS_URL --prefix PREFIX --schema SCHEMA MODE ...
//   follow RID                    plain XREAD of a request's events from the start, until the request is over
//   group RID GROUP CONSUMER N    a consumer group on the request's events, created first (MKSTREAM: the
//                                 reader may arrive before the worker), XREADGROUP COUNT N, XACK each entry
//   terminals GROUP CONSUMER N M  the terminal feed: this consumer's pending entries first, then new ones,
//                                 COUNT N a read, XACK each, until M entries were handled
// Output: JSON lines on stdout: {"ready": true} once reading can start, then one summary object.
// Exit: 0 = done, 2 = usage problem.

import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';

const args = process.argv.slice(2);
const opt = (name) => {
  const i = args.indexOf(name);
  if (i < 0 || i + 1 >= args.length) {
    process.stderr.write(`consume.mjs: ${name} is needed\n`);
    process.exit(2);
  }
  const value = args[i + 1];
  args.splice(i, 2);
  return value;
};
const dir = opt('--ai-dir');
const url = opt('--url');
const prefix = opt('--prefix');
const schemaPath = opt('--schema');
const [mode, ...rest] = args;

const require = createRequire(path.join(dir, 'node_modules', 'noop.js'));
const { createClient } = require('redis');
const Ajv2020 = require('ajv/dist/2020').default;
const validate = new Ajv2020({ strict: true }).compile(JSON.parse(await readFile(schemaPath, 'utf8')));

const TERMINAL_STATES = new Set(['completed', 'failed', 'interrupted']);
const TERMINAL_EVENTS = new Set(['stream.done', 'stream.error']);
const redis = createClient({ url });
await redis.connect();
const out = (doc) => process.stdout.write(JSON.stringify(doc) + '\n');

const eventsKey = (rid) => `${prefix}:{req:${rid}}:events`;
const statusKey = (rid) => `${prefix}:{req:${rid}}:status`;
const attemptOf = (entryId) => Number(entryId.split('-')[0]);

// -- one request's events ----------------------------------------------------------------------

class Request {
  constructor(rid) {
    this.rid = rid;
    this.entries = []; // [entry id, event]
    this.invalid = [];
    this.terminals = {}; // attempt -> terminal event type
    this.status = null;
  }

  add(id, fields) {
    const event = JSON.parse(fields.event);
    if (!validate(event)) this.invalid.push({ id, errors: validate.errors });
    if (event.type !== fields.type) this.invalid.push({ id, errors: ['the type field differs from the event'] });
    this.entries.push([id, event]);
    if (TERMINAL_EVENTS.has(event.type)) this.terminals[attemptOf(id)] = event.type;
  }

  // The stop condition: the status is terminal and the terminal event of the attempt it names was read.
  // An earlier attempt's own stream.error (it was retried) is not the end.
  async over() {
    if (!Object.keys(this.terminals).length) return false;
    this.status = await redis.hGetAll(statusKey(this.rid));
    return TERMINAL_STATES.has(this.status.state) && Number(this.status.attempt) in this.terminals;
  }

  summary(extra = {}) {
    const attempt = Number(this.status.attempt);
    const result = assemble(this.entries.filter(([id]) => attemptOf(id) === attempt).map(([, e]) => e));
    return {
      request_id: this.rid, state: this.status.state, attempt, entries: this.entries.length,
      ids: this.entries.map(([id]) => id), terminals: this.terminals, invalid: this.invalid,
      result, result_hash: resultHash(result), stored_hash: this.status.result_hash, ...extra,
    };
  }
}

// -- the result and its hash, as the guide states them -----------------------------------------

function assemble(events) {
  const blocks = new Map();
  let terminal = null;
  const block = (ref) => {
    if (!blocks.has(ref.index)) {
      blocks.set(ref.index, { index: ref.index, kind: ref.kind, name: null, call_id: null, texts: [], sigs: [] });
    }
    return blocks.get(ref.index);
  };
  for (const ev of events) {
    if (ev.type === 'block.start') {
      Object.assign(block(ev.block), { name: ev.block.name ?? null, call_id: ev.block.call_id ?? null });
    } else if (ev.type === 'block.delta') {
      const b = block(ev.block);
      (ev.delta.kind === 'signature' ? b.sigs : b.texts).push(ev.delta.text);
    } else if (ev.type === 'block.stop') {
      const b = block(ev.block);
      b.stopArguments = ev.arguments ?? null;
      if (ev.arguments_error !== undefined) b.arguments_error = ev.arguments_error;
    } else if (TERMINAL_EVENTS.has(ev.type)) {
      terminal = ev;
    }
  }
  const done = terminal?.type === 'stream.done';
  const out = [...blocks.values()].sort((a, b) => a.index - b.index).map((b) => {
    const tool = b.kind === 'tool_call';
    const text = b.texts.join('');
    const r = {
      index: b.index, kind: b.kind, text: tool ? null : text, signature: b.sigs.join('') || null, name: b.name,
      call_id: b.call_id, arguments: tool && done ? (b.stopArguments ?? null) : null, arguments_text: tool ? text : null,
    };
    if (b.arguments_error !== undefined && b.arguments_error !== null) r.arguments_error = b.arguments_error;
    return r;
  });
  return {
    status: terminal === null ? 'running' : done ? 'completed' : terminal.status,
    stop_reason: done ? terminal.stop_reason : null,
    provider_stop_reason: done ? terminal.provider_stop_reason : null,
    error: done || terminal === null ? null : terminal.error,
    usage: terminal?.usage ?? null,
    blocks: out,
  };
}

// Keys sorted (by code point) at every level, no whitespace, strings as JSON.stringify writes them.
function canonical(value) {
  if (Array.isArray(value)) return `[${value.map(canonical).join(',')}]`;
  if (value !== null && typeof value === 'object') {
    return `{${Object.keys(value).sort().map((k) => `${JSON.stringify(k)}:${canonical(value[k])}`).join(',')}}`;
  }
  return JSON.stringify(value);
}

function resultHash(result) {
  return 'sha256:' + createHash('sha256').update(canonical(result), 'utf8').digest('hex');
}

// -- the recipes ---------------------------------------------------------------------------------

async function createGroup(stream, group) {
  try {
    await redis.xGroupCreate(stream, group, '0', { MKSTREAM: true });
  } catch (e) {
    if (!String(e.message).startsWith('BUSYGROUP')) throw e; // it exists already: fine
  }
}

async function follow(rid) {
  const req = new Request(rid);
  out({ ready: true });
  let position = '0-0';
  for (;;) {
    // A missing stream is read like an empty one: XREAD needs no MKSTREAM.
    const reply = await redis.xRead({ key: eventsKey(rid), id: position }, { COUNT: 100, BLOCK: 1000 });
    for (const { id, message } of reply?.[0]?.messages ?? []) {
      req.add(id, message);
      position = id;
    }
    if (await req.over()) return req.summary();
  }
}

async function group(rid, name, consumer, count) {
  const stream = eventsKey(rid);
  await createGroup(stream, name);
  out({ ready: true });
  const req = new Request(rid);
  let reads = 0;
  for (;;) {
    const reply = await redis.xReadGroup(name, consumer, { key: stream, id: '>' }, { COUNT: count, BLOCK: 1000 });
    reads += 1;
    for (const { id, message } of reply?.[0]?.messages ?? []) {
      req.add(id, message);
      await redis.xAck(stream, name, id);
    }
    if (await req.over()) return req.summary({ reads });
  }
}

async function terminals(name, consumer, count, wanted) {
  const stream = `${prefix}:terminal`;
  await createGroup(stream, name);
  out({ ready: true });
  const handled = [];
  let reads = 0;
  let id = '0'; // this consumer's own pending entries first (a restart), then new ones
  while (handled.length < wanted) {
    const reply = await redis.xReadGroup(name, consumer, { key: stream, id }, { COUNT: count, BLOCK: 1000 });
    reads += 1;
    const messages = reply?.[0]?.messages ?? [];
    if (id === '0' && messages.length === 0) {
      id = '>';
      continue;
    }
    for (const m of messages) {
      handled.push({ id: m.id, fields: m.message });
      await redis.xAck(stream, name, m.id);
    }
  }
  return { entries: handled, reads };
}

let summary;
if (mode === 'follow') summary = await follow(rest[0]);
else if (mode === 'group') summary = await group(rest[0], rest[1], rest[2], Number(rest[3]));
else if (mode === 'terminals') summary = await terminals(rest[0], rest[1], Number(rest[2]), Number(rest[3]));
else {
  process.stderr.write(`consume.mjs: unknown mode ${mode}\n`);
  process.exit(2);
}
out(summary);
await redis.close();
