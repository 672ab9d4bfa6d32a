// The web view's Markdown renderer on agent text, in Node.js with a minimal document (no
// browser): it may only ever make the elements it knows, with text inside, and links only to
// absolute http(s) addresses. Run by tests/web_view.rs; prints what failed and exits 1.
'use strict';

const fs = require('fs');
const path = require('path');

let source = fs.readFileSync(path.join(__dirname, '../../crates/dispatcher/assets/view.js'), 'utf8');
// Hand the renderer out instead of starting a page.
const start = '  const match = location.pathname';
if (!source.includes(start)) throw new Error('view.js no longer starts where this test expects');
source = source.replace(start, '  globalThis.__markdown = markdown;\n  return;\n' + start);

class Element {
  constructor(tag) { this.tag = tag; this.children = []; this.attributes = {}; this.textContent = ''; this.className = ''; }
  append(...children) { this.children.push(...children); }
  setAttribute(name, value) { this.attributes[name] = value; }
  addEventListener() {}
  replaceChildren() { this.children = []; }
  get lastChild() { return this.children[this.children.length - 1]; }
}
globalThis.document = {
  createElement: (tag) => new Element(tag),
  createTextNode: (text) => ({ text }),
  getElementById: () => new Element('div'),
};
globalThis.location = { pathname: '/', href: 'http://127.0.0.1/' };
// eslint-disable-next-line no-eval
(0, eval)(source);
const markdown = globalThis.__markdown;

const ALLOWED = new Set(['div', 'p', 'h3', 'h4', 'h5', 'h6', 'ul', 'ol', 'li', 'blockquote', 'pre', 'code',
  'strong', 'em', 'hr', 'a', 'span', 'table', 'thead', 'tbody', 'tr', 'th', 'td']);
const ATTRIBUTES = new Set(['href', 'rel', 'target', 'title', 'class', 'scope']);

/** Every element of the tree, checked; the text as it reads. */
function walk(node, found) {
  if (node.text !== undefined) return node.text;
  if (!ALLOWED.has(node.tag)) found.push(`a <${node.tag}> element`);
  for (const name of Object.keys(node.attributes)) {
    if (!ATTRIBUTES.has(name)) found.push(`an attribute ${name} on <${node.tag}>`);
  }
  if (node.tag === 'a' && !/^https?:\/\//.test(node.attributes.href || '')) found.push(`a link to ${node.attributes.href}`);
  return node.textContent + node.children.map((child) => walk(child, found)).join('');
}

let failed = 0;
function expect(name, input, check) {
  const found = [];
  const text = walk(markdown(input), found);
  const problem = found.length ? found.join(', ') : check(text);
  if (problem) { failed += 1; console.log(`FAILED: ${name}: ${problem}`); } else console.log(`ok: ${name}`);
}

expect('script tags stay text', '<script>window.__pwned = 1</script>', (t) => (t.includes('<script>window.__pwned = 1</script>') ? null : t));
expect('an <img> stays text', '<img src=x onerror="alert(1)">', (t) => (t.includes('<img src=x onerror="alert(1)">') ? null : t));
expect('a Markdown image is its address', '![tracker](http://127.0.0.1:9/p.png)', (t) => (t.includes('[image: tracker] http://127.0.0.1:9/p.png') ? null : t));
expect('a javascript: link is text', '[click](javascript:alert(1))', (t) => (t.includes('click (javascript:alert(1))') ? null : t));
expect('a data: link is text', '[x](data:text/html,<b>hi</b>)', () => null);
expect('a relative link is text', '[other run](/runs/00000000-0000-0000-0000-000000000000)', (t) => (t.includes('(/runs/') ? null : t));
expect('a link shows its host', '[https://github.com/a/b](https://evil.example/x)', (t) => (t.includes('(evil.example)') ? null : t));
expect('underscores in names stay', 'call window.__pwned and snake_case_name', (t) => (t.includes('window.__pwned and snake_case_name') ? null : t));
expect('emphasis and code', 'a **b** _c_ `d <e>`', (t) => (t === 'a b c d <e>' ? null : t));
expect('a table', '| a | b |\n|---|---|\n| <i>1</i> | 2 |', (t) => (t.includes('<i>1</i>') ? null : t));
expect('deep quotes', `${'>'.repeat(5000)} deep`, (t) => (t.includes('deep') ? null : t));
expect('unclosed links', '[x](a'.repeat(2000), (t) => (t.length >= 10000 ? null : 'text lost'));
expect('a long backtick run', `x ${'`'.repeat(20000)}`, (t) => (t.length === 20002 ? null : `${t.length} characters`));
expect('a long paragraph is kept whole', 'word *x* '.repeat(20000), (t) => (t.length > 100000 ? null : 'text lost'));
process.exitCode = failed ? 1 : 0;
