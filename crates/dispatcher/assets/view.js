// forgepool's web view: the runs (`/`) and one run (`/runs/{id}`), read from the API.
//
// Everything an agent wrote (feedback, reports, logs, diffs, findings) is untrusted: it is put
// on the page only as text nodes (never as markup), links are kept only for http(s) addresses,
// and images are shown as their address, never loaded. The page's Content-Security-Policy
// refuses any other script, image or connection besides.
'use strict';

(() => {
  const TOKEN_KEY = 'forgepool.token';
  const STATES = ['queued', 'running', 'paused', 'delivered', 'delivered_with_warnings', 'blocked', 'failed', 'cancelled'];
  const ACTIVE = new Set(['queued', 'running', 'paused']);
  const LOG_LINES = 2000;
  /** The longest log line kept whole. */
  const LINE_LIMIT = 4096;
  const REFRESH_MS = 3000;
  const main = document.getElementById('main');

  // ---------------------------------------------------------------- elements

  /** An element: `attrs` sets properties (`class`, `text`, `on*` handlers, others as
   * attributes); children are nodes or strings (always text). */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === 'class') node.className = value;
      else if (key === 'text') node.textContent = value;
      else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? '' : String(value));
    }
    append(node, children);
    return node;
  }

  function append(node, children) {
    for (const child of children.flat(Infinity)) {
      if (child === undefined || child === null || child === false) continue;
      node.append(typeof child === 'string' ? document.createTextNode(child) : child);
    }
    return node;
  }

  function replace(node, ...children) {
    node.replaceChildren();
    return append(node, children);
  }

  /** A link, only to absolute http(s) addresses (nothing relative to this page); anything
   * else is shown as text. A label that is not the address is followed by the host, so a
   * link cannot pass for another. */
  function safeLink(url, label) {
    let parsed = null;
    if (/^https?:\/\//i.test(url)) {
      try { parsed = new URL(url); } catch (_) { /* shown as text */ }
    }
    if (!parsed) return document.createTextNode(label === url ? url : `${label} (${url})`);
    const link = el('a', { href: parsed.href, rel: 'noopener noreferrer nofollow', target: '_blank', text: label });
    return label === url ? link : el('span', null, link, el('span', { class: 'muted', text: ` (${parsed.host})` }));
  }

  // ---------------------------------------------------------------- Markdown, safely

  /** The longest text given to the inline parser; a longer paragraph is shown as it is. */
  const INLINE_LIMIT = 16384;
  /** How far a link's label, a link's address and emphasis may reach. */
  const LABEL_LIMIT = 512;
  const ADDRESS_LIMIT = 2048;
  const EMPHASIS_LIMIT = 512;
  const WORD = /[\p{L}\p{N}_]/u;

  /** Where the run of `mark` that closes emphasis opened at `from` starts, or -1: within the
   * limit, not after a space, and for `_` not before a letter or digit (CommonMark's flanking,
   * roughly, so that `window.__name` stays as written). */
  function closing(text, mark, from) {
    const end = Math.min(text.length, from + EMPHASIS_LIMIT);
    let at = text.indexOf(mark, from + 1);
    while (at >= 0 && at < end) {
      const before = text[at - 1];
      const after = text[at + mark.length];
      if (before && !/\s/.test(before) && !(mark[0] === '_' && after && WORD.test(after))) return at;
      at = text.indexOf(mark, at + 1);
    }
    return -1;
  }

  /** `[label](address)` at `at` (after a `!` for an image): [label, address, end] or null. */
  function bracketed(text, at) {
    const close = text.indexOf(']', at + 1);
    if (close < 0 || close - at > LABEL_LIMIT || text[close + 1] !== '(') return null;
    const end = text.indexOf(')', close + 2);
    if (end < 0 || end - close > ADDRESS_LIMIT) return null;
    const address = text.slice(close + 2, end).trim().split(/\s/)[0];
    return [text.slice(at + 1, close), address, end + 1];
  }

  /** Inline Markdown as nodes: code, images (as their address), links, strong, emphasis. One
   * pass, each construct found with bounded searches: no input makes it slow. */
  function inline(text) {
    if (text.length > INLINE_LIMIT) return [text];
    const nodes = [];
    let plain = '';
    let i = 0;
    const emit = (node, next) => {
      if (plain) nodes.push(plain);
      plain = '';
      nodes.push(node);
      i = next;
    };
    while (i < text.length) {
      const c = text[i];
      if (c === '`') {
        let n = 1;
        while (text[i + n] === '`') n += 1;
        const fence = '`'.repeat(n);
        let close = text.indexOf(fence, i + n);
        while (close >= 0 && text[close + n] === '`') {
          let skip = close;
          while (text[skip] === '`') skip += 1;
          close = text.indexOf(fence, skip);
        }
        if (close > i + n) { emit(el('code', { text: text.slice(i + n, close) }), close + n); continue; }
        plain += fence;
        i += n;
        continue;
      }
      if (c === '!' && text[i + 1] === '[') {
        const found = bracketed(text, i + 1);
        if (found) {
          emit(el('span', { class: 'image-ref', title: 'an image, not loaded', text: `[image${found[0] ? `: ${found[0]}` : ''}] ${found[1]}` }), found[2]);
          continue;
        }
      } else if (c === '[') {
        const found = bracketed(text, i);
        if (found && found[0]) { emit(safeLink(found[1], found[0]), found[2]); continue; }
      } else if (c === '*' || c === '_') {
        const mark = text[i + 1] === c ? c + c : c;
        const opens = !(c === '_' && i > 0 && WORD.test(text[i - 1])) && text[i + mark.length] && !/\s/.test(text[i + mark.length]);
        const close = opens ? closing(text, mark, i + mark.length - 1) : -1;
        if (close > i + mark.length) {
          emit(el(mark.length === 2 ? 'strong' : 'em', { text: text.slice(i + mark.length, close) }), close + mark.length);
          continue;
        }
        plain += mark;
        i += mark.length;
        continue;
      }
      plain += c;
      i += 1;
    }
    if (plain) nodes.push(plain);
    return nodes;
  }

  /** Markdown as nodes: headings, paragraphs, lists, quotes, fenced code, rules. */
  function markdown(source, depth = 0) {
    const out = el('div', { class: 'md' });
    const lines = String(source || '').replace(/\r\n?/g, '\n').split('\n');
    let i = 0;
    let paragraph = [];
    const flush = () => {
      if (paragraph.length) out.append(el('p', null, inline(paragraph.join(' '))));
      paragraph = [];
    };
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(/^\s*(```|~~~)/);
      if (fence) {
        flush();
        const body = [];
        i += 1;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
        i += 1;
        out.append(el('pre', null, el('code', { text: body.join('\n') })));
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flush();
        out.append(el(`h${Math.min(6, heading[1].length + 2)}`, null, inline(heading[2])));
        i += 1;
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); out.append(el('hr')); i += 1; continue; }
      if (/^\s*\|/.test(line) && i + 1 < lines.length && /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/.test(lines[i + 1])) {
        flush();
        const cells = (row) => row.trim().replace(/^\|/, '').replace(/\|$/, '').split('|').map((cell) => cell.trim());
        const head = cells(line);
        const rows = [];
        i += 2;
        while (i < lines.length && /^\s*\|/.test(lines[i])) rows.push(cells(lines[i++]));
        out.append(el('div', { class: 'table-wrap' }, el('table', null,
          el('thead', null, el('tr', null, head.map((cell) => el('th', { scope: 'col' }, inline(cell))))),
          el('tbody', null, rows.map((row) => el('tr', null, row.map((cell) => el('td', null, inline(cell)))))))));
        continue;
      }
      const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
      if (item) {
        flush();
        const list = el(/\d/.test(item[1]) ? 'ol' : 'ul');
        while (i < lines.length) {
          const next = lines[i].match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
          if (next) list.append(el('li', null, inline(next[2])));
          else if (/^\s{2,}\S/.test(lines[i]) && list.lastChild) append(list.lastChild, [' ', ...inline(lines[i].trim())]);
          else break;
          i += 1;
        }
        out.append(list);
        continue;
      }
      if (/^\s*>/.test(line) && depth < 8) {
        flush();
        const quoted = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ''));
        out.append(el('blockquote', null, markdown(quoted.join('\n'), depth + 1)));
        continue;
      }
      if (!line.trim()) { flush(); i += 1; continue; }
      paragraph.push(line.trim());
      i += 1;
    }
    flush();
    return out;
  }

  // ---------------------------------------------------------------- the API

  let tokenPromise = null;

  /** Asks for the token once, whatever number of requests were refused meanwhile. */
  function askToken(message) {
    if (tokenPromise) return tokenPromise;
    const dialog = document.getElementById('token-dialog');
    const form = document.getElementById('token-form');
    const input = document.getElementById('token-input');
    document.getElementById('token-error').textContent = message || '';
    tokenPromise = new Promise((resolve) => {
      form.onsubmit = (event) => {
        event.preventDefault();
        const token = input.value.trim();
        if (!token) return;
        sessionStorage.setItem(TOKEN_KEY, token);
        input.value = '';
        dialog.close();
        tokenPromise = null;
        resolve();
      };
    });
    if (!dialog.open) dialog.showModal();
    input.focus();
    return tokenPromise;
  }

  function headers(extra) {
    const all = Object.assign({}, extra);
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) all.Authorization = `Bearer ${token}`;
    return all;
  }

  /** A JSON request; a refused token asks for another and tries again. */
  async function api(path, options) {
    for (;;) {
      const sent = sessionStorage.getItem(TOKEN_KEY);
      const response = await fetch(path, Object.assign({}, options, { headers: headers({ Accept: 'application/json' }) }));
      if (response.status === 401) {
        await askToken(sent ? 'The dispatcher refused that token.' : '');
        continue;
      }
      if (!response.ok) {
        let detail = `${response.status} ${response.statusText}`;
        try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
        const error = new Error(detail);
        error.status = response.status;
        throw error;
      }
      return response.json();
    }
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  /** Follows a run's event stream from `after`, reconnecting with `Last-Event-ID`, until the
   * server ends it (the run ended or paused) or `signal` aborts. */
  async function follow(runId, after, onEvent, signal) {
    let last = after;
    while (!signal.aborted) {
      try {
        const extra = { Accept: 'text/event-stream' };
        if (last) extra['Last-Event-ID'] = String(last);
        const response = await fetch(`/v1/runs/${runId}/events`, { headers: headers(extra), signal });
        if (response.status === 401) { await askToken('The dispatcher refused that token.'); continue; }
        if (!response.ok) throw new Error(`${response.status}`);
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = '';
        for (;;) {
          const { value, done } = await reader.read();
          if (done) return;
          buffer += value.replace(/\r\n?/g, '\n');
          let end;
          while ((end = buffer.indexOf('\n\n')) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            let id = null;
            const data = [];
            for (const line of block.split('\n')) {
              if (line.startsWith('id:')) id = line.slice(3).trim();
              else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
            }
            if (!data.length) continue;
            if (id) last = Number(id);
            try { onEvent(Number(id), JSON.parse(data.join('\n'))); } catch (error) { console.error(error); }
          }
        }
      } catch (error) {
        if (signal.aborted) return;
        await sleep(2000);
      }
    }
  }

  // ---------------------------------------------------------------- formatting

  function seconds(total) {
    if (total === null || total === undefined || Number.isNaN(total)) return '–';
    if (total < 60) return `${total.toFixed(total < 10 ? 1 : 0)} s`;
    const minutes = Math.floor(total / 60);
    if (minutes < 60) return `${minutes} min ${Math.round(total % 60)} s`;
    return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
  }

  function age(time) {
    const elapsed = (Date.now() - Date.parse(time)) / 1000;
    if (Number.isNaN(elapsed)) return '–';
    if (elapsed < 60) return 'just now';
    if (elapsed < 3600) return `${Math.floor(elapsed / 60)} min ago`;
    if (elapsed < 86400) return `${Math.floor(elapsed / 3600)} h ago`;
    return `${Math.floor(elapsed / 86400)} d ago`;
  }

  function duration(run) {
    const start = Date.parse(run.created_at);
    const end = ACTIVE.has(run.state) ? Date.now() : Date.parse(run.updated_at);
    return seconds((end - start) / 1000);
  }

  const badge = (state) => el('span', { class: `badge state-${state}`, text: state.replace(/_/g, ' ') });
  const stageName = (stage) => ({ implement: 'Implement', verify: 'Verify', review: 'Review', final_review: 'Final review' }[stage] || stage);

  function usageText(usage) {
    if (!usage) return null;
    const parts = [];
    if (usage.input_tokens || usage.output_tokens) parts.push(`${usage.input_tokens || 0} in / ${usage.output_tokens || 0} out tokens`);
    if (usage.cost_usd) parts.push(`$${Number(usage.cost_usd).toFixed(2)}`);
    return parts.join(', ') || null;
  }

  // ---------------------------------------------------------------- the pool

  async function showPool() {
    const pool = document.getElementById('pool');
    try {
      const figures = await api('/v1/pool');
      const waiting = Object.entries(figures.waiting_for_profile || {});
      const paused = (figures.runs_by_state || {}).paused || 0;
      // Each host with its live workers' busy and total slots; its workers on hover.
      const hosts = (figures.hosts || []).map((host) => {
        const busy = host.workers.reduce((n, w) => n + w.busy, 0);
        const slots = host.workers.reduce((n, w) => n + w.slots, 0);
        const workers = host.workers.map((w) => `${w.worker}: ${w.busy}/${w.slots} busy, seen ${w.seen_seconds_ago} s ago`).join('\n');
        return el('span', { class: 'host', title: workers, text: `${host.host} ${busy}/${slots}` });
      });
      replace(pool,
        el('span', null, 'Queue ', el('strong', { text: String(figures.queue_depth) })),
        el('span', null, 'Workers ', el('strong', { text: String(figures.workers) })),
        el('span', null, 'Busy slots ', el('strong', { text: String(figures.busy_slots) })),
        el('span', null, 'Paused runs ', el('strong', { text: String(paused) })),
        el('span', { class: 'hosts' }, 'Hosts ', hosts.length ? hosts : el('strong', { text: 'none alive' })),
        waiting.length ? el('span', null, 'At their cap: ', waiting.map(([p, n]) => `${p} (${n})`).join(', ')) : null);
    } catch (error) {
      replace(pool, el('span', { class: 'error', text: `Pool: ${error.message}` }));
    }
  }

  // ---------------------------------------------------------------- `/`

  async function listPage() {
    document.title = 'Runs · forgepool';
    const query = new URLSearchParams(location.search);
    const cursors = [];
    let cursor = query.get('cursor') || '';
    const stateSelect = el('select', { id: 'filter-state', name: 'state' },
      el('option', { value: '', text: 'any' }), STATES.map((s) => el('option', { value: s, text: s.replace(/_/g, ' ') })));
    stateSelect.value = query.get('state') || '';
    const ticket = el('input', { id: 'filter-ticket', name: 'ticket', value: query.get('ticket') || '', placeholder: 'SHOP-123', autocomplete: 'off' });
    const skill = el('input', { id: 'filter-skill', name: 'skill', value: query.get('skill') || '', placeholder: 'any skill', autocomplete: 'off' });
    const table = el('tbody');
    const status = el('p', { class: 'muted', role: 'status', 'aria-live': 'polite' });
    const newer = el('button', { type: 'button', text: '← Newer', disabled: true });
    const older = el('button', { type: 'button', text: 'Older →', disabled: true });
    const form = el('form', { class: 'filters', role: 'search', 'aria-label': 'Filter runs' },
      el('label', null, 'State', stateSelect),
      el('label', null, 'Ticket', ticket),
      el('label', null, 'Skill', skill),
      el('button', { type: 'submit', text: 'Filter' }));
    replace(main,
      el('h1', { text: 'Runs' }),
      form,
      el('div', { class: 'table-wrap' }, el('table', { class: 'runs' },
        el('caption', { class: 'visually-hidden', text: 'Runs, newest first' }),
        el('thead', null, el('tr', null, ['Run', 'State', 'Ticket', 'Skill', 'Profile', 'Age', 'Duration', 'Rounds', 'Cycles'].map((h) => el('th', { scope: 'col', text: h })))),
        table)),
      el('nav', { class: 'pager', 'aria-label': 'Pages' }, newer, older),
      status);

    let next = null;
    const load = async () => {
      const params = new URLSearchParams();
      if (stateSelect.value) params.set('state', stateSelect.value);
      if (ticket.value.trim()) params.set('ticket', ticket.value.trim());
      if (skill.value.trim()) params.set('skill', skill.value.trim());
      const shown = new URLSearchParams(params);
      if (cursor) { params.set('cursor', cursor); shown.set('cursor', cursor); }
      history.replaceState(null, '', shown.toString() ? `/?${shown}` : '/');
      params.set('limit', '50');
      try {
        const page = await api(`/v1/runs?${params}`);
        next = page.next_cursor || null;
        older.disabled = !next;
        newer.disabled = cursors.length === 0 && !cursor;
        replace(table, page.runs.map((run) => el('tr', null,
          el('td', { 'data-label': 'Run' }, el('a', { href: `/runs/${run.run_id}`, class: 'mono', text: run.run_id.slice(0, 8) })),
          el('td', { 'data-label': 'State' }, badge(run.state)),
          el('td', { 'data-label': 'Ticket', text: run.ticket }),
          el('td', { 'data-label': 'Skill', text: run.skill || '–' }),
          el('td', { 'data-label': 'Profile', text: run.profile || '–' }),
          el('td', { 'data-label': 'Age' }, el('time', { datetime: run.created_at, title: run.created_at, text: age(run.created_at) })),
          el('td', { 'data-label': 'Duration', text: duration(run) }),
          el('td', { 'data-label': 'Rounds', class: 'num', text: String(run.rounds) }),
          el('td', { 'data-label': 'Cycles', class: 'num', text: String(run.cycles) }))));
        status.textContent = page.runs.length ? '' : 'No runs match.';
      } catch (error) {
        status.textContent = `Cannot list the runs: ${error.message}`;
      }
    };
    form.addEventListener('submit', (event) => { event.preventDefault(); cursor = ''; cursors.length = 0; load(); });
    older.addEventListener('click', () => { if (next) { cursors.push(cursor); cursor = next; load(); } });
    newer.addEventListener('click', () => { cursor = cursors.pop() || ''; load(); });
    await Promise.all([load(), showPool()]);
    setInterval(() => { if (!document.hidden) { load(); showPool(); } }, REFRESH_MS);
  }

  // ---------------------------------------------------------------- `/runs/{id}`

  /** A stage's spending, as its `stage_finished` reported it: tokens and cost. */
  function usageText(usage) {
    if (!usage) return null;
    const parts = [`${usage.input_tokens || 0} in`, `${usage.output_tokens || 0} out`];
    if (usage.cache_read_tokens) parts.push(`${usage.cache_read_tokens} cached`);
    if (usage.cost_usd) parts.push(`$${Number(usage.cost_usd).toFixed(4)}`);
    if (usage.model) parts.push(usage.model);
    return parts.join(' · ');
  }

  const ROLE_LABELS = { assistant: 'Agent', user: 'User', system: 'System', tool_call: 'Tool call', tool_result: 'Result', error: 'Error' };

  /** A transcript's entries, each collapsed to its first line; errors and failed tool results
   * are marked. Everything in it is the agent's: text nodes only. */
  function transcriptView(data) {
    const entries = data.transcript.entries || [];
    const list = el('ol', { class: 'transcript', 'aria-label': `Transcript of ${stageName(data.stage)}` },
      entries.map((entry) => {
        const first = String(entry.text).split('\n', 1)[0];
        const label = `${ROLE_LABELS[entry.role] || entry.role}${entry.tool ? ` · ${entry.tool}` : ''}`;
        return el('li', { class: `entry role-${String(entry.role).replace(/[^a-z_]/g, '')}${entry.is_error ? ' failing' : ''}` },
          el('details', null,
            el('summary', null, el('strong', { text: label }), ' ', el('span', { class: 'muted mono', text: first.length > 160 ? `${first.slice(0, 160)}…` : first })),
            el('pre', { class: 'output', text: entry.text })));
      }));
    const omitted = data.transcript.omitted ? el('p', { class: 'muted', text: `${data.transcript.omitted} more entries were not kept (the transcript is bounded).` }) : null;
    return el('div', null, el('p', { class: 'muted', text: `${data.agent} · ${entries.length} entries` }), list, omitted);
  }

  /** A finished stage opens to its transcript, fetched when it is first opened and kept. */
  function stageDetails(runId, model, item, label, detail) {
    const usage = usageText(item.finished.usage);
    const box = el('div', { class: 'transcript-body' });
    const fill = (data) => replace(box, data.error ? el('p', { class: 'muted', text: data.error }) : transcriptView(data));
    const details = el('details', { class: 'stage', open: model.open.has(item.index) },
      el('summary', null, el('strong', { text: label }), ' ', el('span', { class: 'muted', text: detail }),
        usage ? el('span', { class: 'usage muted', text: ` · ${usage}` }) : null),
      box);
    const load = async () => {
      if (model.transcripts.has(item.index)) return fill(model.transcripts.get(item.index));
      replace(box, el('p', { class: 'muted', text: 'Loading the transcript…' }));
      let data;
      try {
        data = await api(`/v1/runs/${runId}/stages/${item.index}/transcript`);
      } catch (error) {
        data = { error: error.status === 404 ? 'No transcript: this stage ran a command, not an agent kind.' : `Cannot read the transcript: ${error.message}` };
      }
      model.transcripts.set(item.index, data);
      fill(data);
    };
    details.addEventListener('toggle', () => {
      if (details.open) { model.open.add(item.index); load(); } else model.open.delete(item.index);
    });
    if (details.open) load();
    return details;
  }

  function timelineSection(runId, model) {
    const list = el('ol', { class: 'timeline' });
    for (const item of model.items) {
      if (item.kind === 'state') {
        list.append(el('li', { class: 'tl-state' }, badge(item.state), ' ', item.reason, ' ', el('time', { class: 'muted', datetime: item.time, text: new Date(item.time).toLocaleTimeString() })));
      } else {
        const label = `${stageName(item.stage)} · round ${item.round}${item.cycle ? ` · cycle ${item.cycle}` : ''}`;
        const done = item.finished;
        const detail = done
          ? `${seconds(done.duration_seconds)} · ${done.outcome.replace(/_/g, ' ')}${done.exit_code !== null && done.exit_code !== undefined ? ` (exit ${done.exit_code})` : ''}`
          : `running for ${seconds((Date.now() - Date.parse(item.time)) / 1000)}`;
        list.append(el('li', { class: done ? `tl-stage outcome-${done.outcome}` : 'tl-stage running' },
          done && item.index && item.stage !== 'verify'
            ? stageDetails(runId, model, item, label, detail)
            : [el('strong', { text: label }), ' ', el('span', { class: done ? 'muted' : 'muted elapsed', 'data-since': done ? null : item.time, text: detail })]));
      }
    }
    return el('section', { 'aria-labelledby': 'h-timeline' }, el('h2', { id: 'h-timeline', text: 'Timeline' }),
      model.items.length ? list : el('p', { class: 'muted', text: 'Nothing has happened yet.' }));
  }

  function cyclesSection(run) {
    if (!run.cycles.length) return null;
    return el('section', { 'aria-labelledby': 'h-cycles' }, el('h2', { id: 'h-cycles', text: 'Review cycles' }),
      run.cycles.map((cycle) => el('article', { class: `cycle verdict-${String(cycle.verdict).toLowerCase()}` },
        el('h3', null, `Review cycle ${cycle.cycle}${cycle.max_cycles ? `/${cycle.max_cycles}` : ''}: `,
          el('span', { class: 'verdict', text: String(cycle.verdict).toUpperCase() })),
        el('p', { class: 'muted mono', text: `${cycle.step}/${cycle.file}` }),
        markdown(cycle.feedback))));
  }

  function checkItem(check) {
    const ok = check.exit_code === 0;
    return el('details', { class: ok ? 'check ok' : 'check failing', open: !ok },
      el('summary', null, el('span', { class: 'mono', text: check.argv.join(' ') }), ' ',
        el('span', { class: ok ? 'pass' : 'fail', text: ok ? 'passed' : `failed (exit ${check.exit_code === null ? 'none' : check.exit_code})` }),
        ' ', el('span', { class: 'muted', text: seconds(check.duration_seconds) })),
      check.output_tail ? el('pre', { class: 'output', text: check.output_tail }) : null);
  }

  function roundsSection(run, model) {
    const rounds = run.repair_history || [];
    const checks = model.checks;
    if (!rounds.length && !checks.length) return null;
    const numbers = [...new Set([...rounds.map((r) => r.round), ...checks.map((c) => c.round)])].sort((a, b) => a - b);
    return el('section', { 'aria-labelledby': 'h-rounds' }, el('h2', { id: 'h-rounds', text: 'Rounds and checks' }),
      numbers.map((n) => {
        const record = rounds.find((r) => r.round === n);
        const own = checks.filter((c) => c.round === n);
        return el('article', { class: 'round' },
          el('h3', { text: `Round ${n}${record ? ` · ${record.reason.replace(/_/g, ' ')}` : ''}` }),
          record && record.failing.length ? el('p', null, 'Failing: ', record.failing.map(([argv, code]) => `${argv.join(' ')} (exit ${code === null ? 'none' : code})`).join('; ')) : null,
          own.map(checkItem),
          !own.length && record && record.output_tail ? el('pre', { class: 'output', text: record.output_tail }) : null);
      }));
  }

  function finalReviewSection(result) {
    const report = result && result.final_review;
    if (!report) return null;
    return el('section', { 'aria-labelledby': 'h-final' }, el('h2', { id: 'h-final', text: 'Final review' }),
      el('p', null, 'Verdict: ', el('strong', { text: report.approved ? 'approved' : 'changes required' })),
      markdown(report.summary),
      report.findings.length ? el('div', { class: 'table-wrap' }, el('table', { class: 'findings' },
        el('caption', { class: 'visually-hidden', text: 'Findings' }),
        el('thead', null, el('tr', null, ['Severity', 'Where', 'Finding', 'Evidence'].map((h) => el('th', { scope: 'col', text: h })))),
        el('tbody', null, report.findings.map((f) => el('tr', null,
          el('td', { text: f.severity }), el('td', { class: 'mono', text: `${f.path}:${f.line}` }),
          el('td', { text: f.summary }), el('td', null, el('pre', { class: 'evidence', text: f.evidence }))))))) : null);
  }

  function diffView(text) {
    const pre = el('pre', { class: 'diff', tabindex: '0', 'aria-label': 'The change' });
    for (const line of text.split('\n')) {
      const kind = line.startsWith('+++') || line.startsWith('---') ? 'file'
        : line.startsWith('+') ? 'add' : line.startsWith('-') ? 'del' : line.startsWith('@@') ? 'hunk' : '';
      pre.append(el('span', { class: kind, text: `${line}\n` }));
    }
    return pre;
  }

  function factsSection(run, model) {
    const result = run.result;
    const facts = [
      ['State', badge(run.state)],
      ['Skill', `${run.skill} · step ${run.step}`],
      ['Submitted', run.states.length ? new Date(run.states[0].time).toLocaleString() : '–'],
      ['Rounds', `${run.implementation_rounds} (repair budget ${run.repair_budget})`],
      ['Cycles', String(run.cycles.length)],
    ];
    if (run.waiting_for_profile) facts.push(['Waiting for', `profile ${run.waiting_for_profile} (at its cap)`]);
    if (result && result.branch) facts.push(['Branch', el('span', { class: 'mono', text: result.branch })]);
    if (result && result.commit) facts.push(['Commit', el('span', { class: 'mono', text: result.commit })]);
    const pull = (result && result.pull_request) || model.pullRequest;
    if (pull) facts.push(['Pull request', safeLink(pull, pull)]);
    const usage = usageText(run.usage);
    if (usage) facts.push(['Usage', usage]);
    if (result) facts.push(['Outcome', result.reason]);
    return el('dl', { class: 'facts' }, facts.map(([k, v]) => [el('dt', { text: k }), el('dd', null, v)]));
  }

  function actions(run, reload) {
    const box = el('div', { class: 'actions' });
    const message = el('span', { class: 'muted', role: 'status', 'aria-live': 'polite' });
    if (ACTIVE.has(run.state)) {
      let armed = false;
      const cancel = el('button', { type: 'button', class: 'danger', text: 'Cancel run' });
      cancel.addEventListener('click', async () => {
        if (!armed) { armed = true; cancel.textContent = 'Confirm cancel'; return; }
        cancel.disabled = true;
        try {
          const answer = await api(`/v1/runs/${run.run_id}/cancel`, { method: 'POST' });
          message.textContent = answer.cancel === 'done' ? 'Cancelled.' : 'Cancel requested; the worker stops the run.';
          reload();
        } catch (error) { message.textContent = `Cannot cancel: ${error.message}`; cancel.disabled = false; }
      });
      box.append(cancel);
    }
    if (run.state === 'paused') {
      const resume = el('button', { type: 'button', text: 'Resume run' });
      resume.addEventListener('click', async () => {
        resume.disabled = true;
        try {
          const answer = await api(`/v1/runs/${run.run_id}/resume`, { method: 'POST' });
          message.textContent = `Resumed from checkpoint ${answer.checkpoint}.`;
          reload();
        } catch (error) { message.textContent = `Cannot resume: ${error.message}`; resume.disabled = false; }
      });
      box.append(resume);
    }
    box.append(message);
    return box;
  }

  /** What the page keeps of the events: the timeline's items, the checks, the log. */
  function newModel() {
    return { items: [], stages: new Map(), started: 0, open: new Set(), transcripts: new Map(), checks: [], pullRequest: null, log: [], logStage: null };
  }

  function take(model, event) {
    // An event's kind and its fields are in the event itself (`type`, `state`, `stage`…).
    const kind = event;
    switch (kind.type) {
      case 'state':
        model.items.push({ kind: 'state', state: kind.state, reason: kind.reason, time: event.time });
        break;
      case 'stage_started': {
        // Stages are numbered as the API's transcripts are: from 1, in the order they started.
        model.started += 1;
        const item = { kind: 'stage', index: model.started, stage: kind.stage, round: kind.round, cycle: kind.cycle, time: event.time, finished: null };
        model.stages.set(`${kind.stage}/${kind.round}/${kind.cycle}`, item);
        model.items.push(item);
        break;
      }
      case 'stage_finished': {
        const key = `${kind.stage}/${kind.round}/${kind.cycle}`;
        let item = model.stages.get(key);
        if (!item) {
          item = { kind: 'stage', stage: kind.stage, round: kind.round, cycle: kind.cycle, time: event.time };
          model.items.push(item);
        }
        item.finished = kind;
        model.stages.delete(key);
        break;
      }
      case 'check': model.checks.push(kind.result); break;
      case 'pull_request': model.pullRequest = kind.url; break;
      case 'log':
        model.logStage = kind.stage;
        for (const line of String(kind.text).replace(/\n$/, '').split('\n')) model.log.push(line.length > LINE_LIMIT ? `${line.slice(0, LINE_LIMIT)}…` : line);
        if (model.log.length > LOG_LINES) model.log.splice(0, model.log.length - LOG_LINES);
        return 'log';
      default: return null;
    }
    return 'timeline';
  }

  async function runPage(runId) {
    document.title = 'Run · forgepool';
    let run;
    let timeline;
    try {
      [run, timeline] = await Promise.all([api(`/v1/runs/${runId}`), api(`/v1/runs/${runId}/timeline`)]);
    } catch (error) {
      replace(main, el('h1', { text: 'Run' }), el('p', { class: 'error', text: error.status === 404 ? `No run ${runId}.` : `Cannot read the run: ${error.message}` }), el('p', null, el('a', { href: '/', text: 'All runs' })));
      return;
    }
    const model = newModel();
    for (const { event } of timeline.events) take(model, event);
    for (const { event } of timeline.log_tail) take(model, event);

    const head = el('div');
    const body = el('div');
    const results = el('div');
    const logPre = el('pre', { class: 'log', tabindex: '0', 'aria-label': 'Live log', 'aria-live': 'off' });
    const logTitle = el('h2', { id: 'h-log', text: 'Log' });
    const logSection = el('section', { 'aria-labelledby': 'h-log' }, logTitle, logPre);
    replace(main, head, body, results, logSection);

    const drawLog = () => {
      const atBottom = logPre.scrollTop + logPre.clientHeight >= logPre.scrollHeight - 8;
      logPre.textContent = model.log.length ? model.log.join('\n') : 'No output yet.';
      logTitle.textContent = model.logStage ? `Log · ${stageName(model.logStage)}` : 'Log';
      if (atBottom) logPre.scrollTop = logPre.scrollHeight;
    };
    let reloading = null;
    let following = false;
    let lastPosition = timeline.last_position;
    const reload = () => {
      if (reloading) return;
      reloading = setTimeout(async () => {
        reloading = null;
        try {
          run = await api(`/v1/runs/${runId}`);
          drawHead();
          drawBody();
          drawResults();
          live();
        } catch (_) {
          // The dispatcher is away (a restart): try again, so the page goes on following.
          setTimeout(reload, 3000);
        }
      }, 250);
    };
    const drawHead = () => {
      document.title = `${run.ticket} · ${run.state.replace(/_/g, ' ')} · forgepool`;
      replace(head,
        el('p', null, el('a', { href: '/', text: '← All runs' })),
        el('h1', null, `${run.ticket} `, badge(run.state)),
        el('p', { class: 'muted mono', text: run.run_id }),
        actions(run, reload),
        factsSection(run, model),
        run.warnings.length ? el('ul', { class: 'warnings', 'aria-label': 'Warnings' }, run.warnings.map((w) => el('li', { text: w }))) : null);
    };
    const drawBody = () => {
      replace(body, timelineSection(runId, model), roundsSection(run, model));
    };
    // What changes only with the run itself (cycles, result): drawn again on a reload, not on
    // every stage event, since a change or a report may be long.
    const drawResults = () => {
      const result = run.result;
      replace(results,
        cyclesSection(run),
        finalReviewSection(result),
        result && result.change ? el('section', { 'aria-labelledby': 'h-change' }, el('h2', { id: 'h-change', text: 'Change' }), diffView(result.change)) : null,
        run.report ? el('section', { 'aria-labelledby': 'h-report' }, el('h2', { id: 'h-report', text: 'Report' }), markdown(run.report)) : null);
    };
    let logFrame = null;
    /** Follows the run's events while it is queued or running (a paused run's stream ends at
     * once; a resume from this page starts following again). */
    const live = () => {
      if (following || (run.state !== 'queued' && run.state !== 'running')) return;
      following = true;
      follow(runId, lastPosition, (position, event) => {
        if (position) lastPosition = Math.max(lastPosition, position);
        const changed = take(model, event);
        if (changed === 'log') {
          if (!logFrame) logFrame = requestAnimationFrame(() => { logFrame = null; drawLog(); });
        } else if (changed === 'timeline') {
          drawBody();
        }
        const type = event.type;
        if (type === 'state' || type === 'cycle' || type === 'result' || type === 'pull_request') reload();
      }, new AbortController().signal).then(() => { following = false; reload(); });
    };
    drawHead();
    drawBody();
    drawResults();
    drawLog();
    live();
    showPool();
    setInterval(() => { if (!document.hidden) showPool(); }, REFRESH_MS);
    // The running stage's elapsed time, in place.
    setInterval(() => {
      for (const span of main.querySelectorAll('.elapsed[data-since]')) {
        span.textContent = `running for ${seconds((Date.now() - Date.parse(span.dataset.since)) / 1000)}`;
      }
    }, 1000);
  }

  // ---------------------------------------------------------------- start

  const match = location.pathname.match(/^\/runs\/([0-9a-fA-F-]{36})\/?$/);
  const start = match ? runPage(match[1]) : listPage();
  start.catch((error) => replace(main, el('p', { class: 'error', text: `Something went wrong: ${error.message}` })));
})();
