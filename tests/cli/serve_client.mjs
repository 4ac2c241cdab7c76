// The official OpenAI Node client (npm `openai`, in third_party/npm) against `q3vl serve`, for
// tests/cli/test_serve.sh. Usage: node serve_client.mjs PORT MODEL COMMAND ARGS...
//   answers EVAL.jsonl data|path|stream   one request per record at a time; JSON line per answer (image parts as
//                                         image_url, video parts as video_url: data: URLs, or paths)
//   parallel EVAL.jsonl N DROP            N streaming requests at once over the records; every DROP-th client
//                                         aborts after its first content chunk; JSON line per finished answer
//   errors IMAGE.png                      bad requests: each must get its status and the server stays up
//   video-errors DIR                      bad videos (DIR's files, made by test_video.sh): the same
//   prefix DIR                            requests that share prompt starts, one at a time (greedy); JSON line per
//                                         answer with /metrics' prefix-cache hit and prefill tokens it added
//   abort MS                              a non-streaming request for 3000 tokens whose client leaves after MS ms
//   hello                                 one short chat, streamed and not: {ok, answer} or {status, code, message}
// The API key the client sends is $Q3VL_CLIENT_KEY (default 'unused': a server without a key ignores it). With $SEED,
// `answers` samples at temperature 1 with that seed (what generate draws for its first prompt) instead of greedily.
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const require = createRequire(path.resolve('third_party/npm') + '/');
const OpenAI = require('openai').default ?? require('openai');
const [port, model, cmd, ...args] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: process.env.Q3VL_CLIENT_KEY ?? 'unused', maxRetries: 0, timeout: 300000 });

function records(file) {
  return fs.readFileSync(file, 'utf8').split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l));
}
const mimes = { '.png': 'image/png', '.jpg': 'image/jpeg', '.mp4': 'video/mp4', '.webm': 'video/webm', '.mkv': 'video/x-matroska', '.y4m': 'video/x-yuv4mpegpipe', '.m4a': 'video/mp4' };
const dataUrl = (file, mime) => `data:${mime ?? mimes[path.extname(file)] ?? 'image/png'};base64,` + fs.readFileSync(file).toString('base64');
// A training-data record's prompt (its user turn) as OpenAI chat messages.
function messages(rec, dir, how) {
  const user = rec.messages.find((m) => m.role === 'user');
  const content = user.content.map((p) => {
    if (p.type === 'text') return { type: 'text', text: p.text };
    const url = how === 'path' ? p[p.type] : dataUrl(path.join(dir, p[p.type]));
    return p.type === 'image' ? { type: 'image_url', image_url: { url } } : { type: 'video_url', video_url: { url } };
  });
  return [{ role: 'user', content }];
}
const out = (o) => process.stdout.write(JSON.stringify(o) + '\n');

async function ask(rec, dir, how, maxTokens, onChunk) {
  const body = { model, messages: messages(rec, dir, how), max_tokens: maxTokens, temperature: 0 };
  if (process.env.SEED) Object.assign(body, { temperature: 1, seed: Number(process.env.SEED) });  // generate's prompt 0
  if (how !== 'stream') {
    const r = await client.chat.completions.create(body);
    return { answer: r.choices[0].message.content, finish: r.choices[0].finish_reason, usage: r.usage, id: r.id };
  }
  const stream = await client.chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  let answer = '', finish = null, usage = null, chunks = 0;
  for await (const c of stream) {
    if (c.usage) usage = c.usage;
    if (!c.choices.length) continue;
    if (c.choices[0].delta?.content) {
      answer += c.choices[0].delta.content;
      if (onChunk && onChunk(++chunks, stream)) return null;
    }
    if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
  }
  return { answer, finish, usage, chunks };
}

const maxTokens = Number(process.env.MAX_TOKENS ?? 6);
if (cmd === 'answers') {
  const [file, how] = args;
  const recs = records(file);
  for (let i = 0; i < recs.length; i++) out({ line: i + 1, ...(await ask(recs[i], path.dirname(file), how, maxTokens)) });
} else if (cmd === 'parallel') {
  const [file, n, drop] = [args[0], Number(args[1]), Number(args[2])];
  const recs = records(file);
  const jobs = [];
  let aborted = 0;
  for (let k = 0; k < n; k++) {
    const line = (k % recs.length) + 1;
    const quit = drop > 0 && k % drop === drop - 1;
    jobs.push(ask(recs[line - 1], path.dirname(file), 'stream', maxTokens, (chunks, stream) => {
      if (!quit) return false;
      stream.controller.abort();  // the client goes away mid-stream
      aborted++;
      return true;
    }).then((r) => r && out({ line, ...r }), (e) => { if (!quit) out({ line, error: String(e) }); }));
  }
  await Promise.all(jobs);
  out({ aborted });
} else if (cmd === 'errors') {
  const [png] = args;
  const user = (content) => [{ role: 'user', content }];
  const img = (url) => user([{ type: 'image_url', image_url: { url } }, { type: 'text', text: 'What is it?' }]);
  const cases = [
    ['remote-url', 400, /remote image URLs are not fetched/, { messages: img('https://example.com/a.png') }],
    ['bad-image', 422, /image 1: .*(JPEG|PNG|decode|corrupt)/i, { messages: img('data:image/png;base64,iVBORw0KGgoAAAAA') }],
    ['bad-base64', 400, /base64/, { messages: img('data:image/png;base64,%%%%') }],
    ['path-outside', 400, /'..\/..\/etc\/passwd' is not a readable file under serve.image_dir/, { messages: img('../../etc/passwd') }],
    ['wrong-type', 400, /'max_tokens' must be an integer/, { messages: user('hi'), max_tokens: 'many' }],
    ['n-2', 400, /only n = 1/, { messages: user('hi'), n: 2 }],
    ['bad-role', 400, /unknown role 'robot'/, { messages: [{ role: 'robot', content: 'hi' }] }],
    ['too-long', 413, /the prompt has [0-9]+ tokens; this server's context is/, { messages: user('hello '.repeat(5000)) }],
    ['unknown-model', 404, /does not exist/, { messages: user('hi'), model: 'gpt-9' }],
    ['no-messages', 400, /'messages' is required/, {}],
  ];
  for (const [name, status, pat, body] of cases) {
    try {
      await client.chat.completions.create({ model, max_tokens: 2, ...body });
      out({ name, ok: false, why: 'no error' });
    } catch (e) {
      const msg = e?.error?.message ?? e?.message ?? String(e);
      const ok = e.status === status && pat.test(msg) && e?.error?.type !== undefined;
      out({ name, ok, why: `status ${e.status}, error ${JSON.stringify(e.error)}` });
    }
  }
  // Plain completions, streamed, with a stop string, after all those errors.
  const r = await client.completions.create({ model, prompt: 'The cat', max_tokens: 4, temperature: 0 });
  const s = await client.completions.create({ model, prompt: 'The cat', max_tokens: 4, temperature: 0, stream: true });
  let text = '';
  for await (const c of s) text += c.choices[0]?.text ?? '';
  out({ name: 'completions', ok: r.choices[0].text === text && r.usage.completion_tokens >= 1, why: `${JSON.stringify(r)} vs stream ${JSON.stringify(text)}` });
  const m = await client.models.list();
  out({ name: 'models', ok: m.data.length === 1 && m.data[0].id === model, why: JSON.stringify(m.data) });
  // A stop string cuts the answer before it (the greedy answer up to its second character).
  const full = (await client.chat.completions.create({ model, messages: img(dataUrl(png)), max_tokens: 6, temperature: 0 })).choices[0].message.content;
  const stop = full.slice(1, 3);
  const cut = full.indexOf(stop);
  const st = await client.chat.completions.create({ model, messages: img(dataUrl(png)), max_tokens: 6, temperature: 0, stop: [stop] });
  out({ name: 'stop-string', ok: stop.length === 2 && st.choices[0].message.content === full.slice(0, cut) && st.choices[0].finish_reason === 'stop', why: `full ${JSON.stringify(full)} stop ${JSON.stringify(stop)} got ${JSON.stringify(st.choices[0])}` });
  // Seeded sampling: the same seed gives the same answer.
  const samp = (seed) => client.chat.completions.create({ model, messages: img(dataUrl(png)), max_tokens: 6, temperature: 1.5, top_k: 50, top_p: 0.9, seed });
  const [a, b] = [await samp(7), await samp(7)];
  out({ name: 'seeded-sampling', ok: a.choices[0].message.content === b.choices[0].message.content, why: `${a.choices[0].message.content} vs ${b.choices[0].message.content}` });
} else if (cmd === 'video-errors') {
  const [dir] = args;
  const f = (name) => path.join(dir, name);
  const vid = (url) => [{ role: 'user', content: [{ type: 'text', text: 'What moves?' }, { type: 'video_url', video_url: { url } }] }];
  const part = /^messages\[0\] video 1: /;  // every message names the part
  const cases = [
    ['video: remote URL', 400, /remote video URLs are not fetched/, vid('https://example.com/a.mp4')],
    ['video: not a video MIME type', 400, /must be data:video\/<type>;base64/, vid(dataUrl(f('clip.mp4'), 'image/png'))],
    ['video: bad base64', 400, /base64/, vid('data:video/mp4;base64,%%%%')],
    ['video: path outside serve.image_dir', 400, /'..\/..\/etc\/passwd' is not a readable file under serve.image_dir/, vid('../../etc/passwd')],
    ['video: corrupt bytes', 422, /Invalid data found|cannot open/i, vid(dataUrl(f('junk.mp4')))],
    ['video: truncated file', 422, /moov atom not found|cannot open|Invalid data/i, vid(dataUrl(f('cut.mp4')))],
    ['video: audio only', 422, /has no video stream/, vid(dataUrl(f('audio.m4a')))],
    ['video: zero frames', 422, /no frames/, vid(dataUrl(f('empty.y4m')))],
    ['video: 100000x100000 frames', 422, /100000x100000/, vid(dataUrl(f('huge.y4m')))],
    ['video: frames over serve.max_image_pixels', 422, /1280x1024.*over the limit/, vid(dataUrl(f('big.mp4')))],
    ['video: longer than the context', 413, /become [0-9]+ video tokens, [0-9]+ with the request's images and videos so far; this server's context is 512 tokens/, vid(dataUrl(f('long.mp4')))],
    ['video: in an assistant turn', 400, /user turns only/, [{ role: 'user', content: 'hi' }, { role: 'assistant', content: [{ type: 'video_url', video_url: { url: dataUrl(f('clip.mp4')) } }] }, { role: 'user', content: 'and?' }]],
  ];
  for (const [name, status, pat, messages] of cases) {
    try {
      await client.chat.completions.create({ model, max_tokens: 2, messages });
      out({ name, ok: false, why: 'no error' });
    } catch (e) {
      const msg = e?.error?.message ?? e?.message ?? String(e);
      const named = part.test(msg) || name === 'video: in an assistant turn';  // that one: parse_record's "message 2"
      out({ name, ok: e.status === status && pat.test(msg) && named && e?.error?.type !== undefined, why: `status ${e.status}, error ${JSON.stringify(e.error)}` });
    }
  }
  // The server still answers, a video too.
  const r = await client.chat.completions.create({ model, max_tokens: 2, temperature: 0, messages: vid(dataUrl(f('clip.mp4'))) });
  out({ name: 'video: answers after the bad videos', ok: r.choices[0].finish_reason !== undefined && r.usage.prompt_tokens > 20, why: JSON.stringify(r) });
} else if (cmd === 'prefix') {
  const [dir] = args;
  const metric = async (name) => {
    const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
    return Number(text.match(new RegExp(`^${name} (\\S+)$`, 'm'))[1]);
  };
  const words = (n, from) => Array.from({ length: n }, (_, i) => ['red', 'blue', 'square', 'star', 'small', 'the', 'a', 'shape'][(i * 7 + from) % 8]).join(' ');
  const img = (f, text) => [{ role: 'user', content: [{ type: 'image_url', image_url: { url: dataUrl(path.join(dir, 'images', f)) } }, { type: 'text', text }] }];
  const system = { role: 'system', content: 'You answer questions about pictures. ' + words(30, 1) };
  const q = 'What is in this image? ' + words(12, 3);
  const steps = [
    ['image', img('eval_000000.png', q)],
    ['image-again', img('eval_000000.png', q)],          // all full blocks but the last token's from the cache
    ['other-image', img('eval_000001.png', q)],          // same placeholder tokens, other pixels: no reuse past them
    ['system-a', [system, { role: 'user', content: 'Which colour is the sky?' }]],
    ['system-b', [system, { role: 'user', content: 'Which shape has five points?' }]],  // shares part of a block
  ];
  const answers = {};
  const turn2 = () => [system, { role: 'user', content: 'Which colour is the sky?' }, { role: 'assistant', content: answers['system-a'] }, { role: 'user', content: 'And the grass?' }];
  // The next turn of a chat resends the history: its blocks (the answer's too) come from the cache.
  for (const [name, msgs] of [...steps, ['second-turn', turn2]]) {
    const messages = typeof msgs === 'function' ? msgs() : msgs;
    const [h0, p0] = [await metric('q3vl_prefix_cache_hit_tokens_total'), await metric('q3vl_prefill_tokens_total')];
    const r = await client.chat.completions.create({ model, messages, max_tokens: maxTokens, temperature: 0 });
    const answer = r.choices[0].message.content;
    const [hit, prefill] = [(await metric('q3vl_prefix_cache_hit_tokens_total')) - h0, (await metric('q3vl_prefill_tokens_total')) - p0];
    // A random model's greedy answers say little (often one token repeated); a seeded sample follows the logits.
    const s = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 1, seed: 5 });
    out({ name, answer, sample: s.choices[0].message.content, prompt_tokens: r.usage.prompt_tokens, hit, prefill });
    answers[name] = answer;
  }
} else if (cmd === 'abort') {
  const ms = Number(args[0]);
  const ac = new AbortController();
  setTimeout(() => ac.abort(), ms);
  const t0 = Date.now();
  try {
    const r = await client.completions.create({ model, prompt: 'The dog ran', max_tokens: 3000, temperature: 0 }, { signal: ac.signal });
    out({ aborted: false, finish: r.choices[0].finish_reason, tokens: r.usage.completion_tokens, ms: Date.now() - t0 });
  } catch (e) {
    out({ aborted: true, error: String(e), ms: Date.now() - t0 });
  }
} else if (cmd === 'hello') {
  const body = { model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 2, temperature: 0 };
  for (const stream of [false, true]) {
    try {
      let answer = '';
      if (stream) for await (const c of await client.chat.completions.create({ ...body, stream })) answer += c.choices[0]?.delta?.content ?? '';
      else answer = (await client.chat.completions.create(body)).choices[0].message.content;
      out({ stream, ok: true, answer });
    } catch (e) {
      out({ stream, status: e.status, code: e.code ?? e.error?.code, type: e.type ?? e.error?.type, message: e.message });
    }
  }
} else {
  console.error(`unknown command ${cmd}`);
  process.exit(2);
}
