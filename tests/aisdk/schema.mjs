#!/usr/bin/env node
// Compile sluice's published JSON Schema with ajv's Ajv2020 in strict mode, as a JavaScript consumer
// would, and validate documents with it.
//
// Usage: node schema.mjs --ai-dir DIR SCHEMA < LINES
//   DIR/node_modules holds the pinned ajv; SCHEMA is schemas/contract.schema.json as published.
//   Each stdin line is a JSON array [kind, document], kind "event" (the schema itself) or "result"
//   ($defs/Result).
// Output: one JSON object: {ajv, results: [{valid, errors}]} (one per line, in order).
// Exit: 0 = every document valid, 1 = some invalid, 2 = usage problem or the schema does not compile.

import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';

function fail(msg) {
  process.stderr.write(`schema.mjs: ${msg}\n`);
  process.exit(2);
}

const args = process.argv.slice(2);
const at = args.indexOf('--ai-dir');
if (at < 0 || at + 1 >= args.length) fail('--ai-dir DIR is needed');
const dir = args[at + 1];
const rest = args.filter((_, i) => i !== at && i !== at + 1);
if (rest.length !== 1) fail('one SCHEMA path is needed');

const require = createRequire(path.join(dir, 'node_modules', 'noop.js'));
const Ajv2020 = require('ajv/dist/2020').default;
const ajvVersion = require('ajv/package.json').version;

const schema = JSON.parse(await readFile(rest[0], 'utf8'));
// strict: true turns every strict option on (unknown keywords, strictTypes, strictTuples,
// strictRequired); allErrors only for the report.
const ajv = new Ajv2020({ strict: true, allErrors: true });
let event, result;
try {
  event = ajv.compile(schema);
  result = ajv.compile({ $ref: `${schema.$id}#/$defs/Result` });
} catch (e) {
  fail(`the schema does not compile in strict Ajv2020: ${e.message}`);
}

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const results = [];
for (const line of Buffer.concat(chunks).toString('utf8').split('\n')) {
  if (!line.trim()) continue;
  const [kind, doc] = JSON.parse(line);
  const validate = kind === 'result' ? result : event;
  const valid = validate(doc);
  results.push({ valid, errors: valid ? [] : validate.errors.map((e) => `${e.instancePath} ${e.message}`) });
}
process.stdout.write(JSON.stringify({ ajv: ajvVersion, results }) + '\n');
process.exit(results.every((r) => r.valid) ? 0 : 1);
