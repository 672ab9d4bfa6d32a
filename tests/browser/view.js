// Drives Debian's Chromium through the web view with Playwright (playwright-core, no browser
// download), for tests/web_view.rs, which starts the pool, submits the runs and checks the
// host-side evidence. One phase per call (PHASE):
//   finished  the token prompt, the runs list, a run rejected once then approved, and a run
//             whose reviewer wrote hostile feedback; screenshots of both pages
//   live      the page of a running run moves to the next stage by itself
//   cancel    cancelling from the page stops the run
//   transcript a real agent's stage opens to its transcript (RUN, AGENT, TOOL): collapsed,
//             fetched when opened, with the stage's tokens and cost
// Environment: URL, TOKEN, RUN (or RUN_APPROVED and RUN_HOSTILE), SHOTS (a folder).
// Exits 0 when every check held; otherwise prints what failed and exits 1.
'use strict';

const { chromium } = require('playwright-core');
const path = require('path');

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};

function check(condition, message) {
  if (!condition) throw new Error(message);
  console.log(`ok: ${message}`);
}

async function open(browser, viewport) {
  const context = await browser.newContext({ viewport: viewport || { width: 1280, height: 900 } });
  const page = await context.newPage();
  const requests = [];
  page.on('request', (request) => requests.push(request.url()));
  const errors = [];
  page.on('pageerror', (error) => errors.push(String(error)));
  // A refused token is an expected 401 (the browser logs it); any other error is a bug.
  page.on('console', (message) => {
    if (message.type() === 'error' && !/status of 401/.test(message.text())) errors.push(message.text());
  });
  return { context, page, requests, errors };
}

/** Gives the token when the dialog asks for it (a tab keeps it afterwards). */
async function giveToken(page, token) {
  await page.locator('#token-dialog[open]').waitFor({ timeout: 10000 });
  await page.fill('#token-input', token);
  await page.click('#token-form button[type=submit]');
}

async function finished(browser, url, token, shots) {
  const approved = env('RUN_APPROVED');
  const hostile = env('RUN_HOSTILE');
  const { page, requests, errors, context } = await open(browser);
  await page.goto(`${url}/`);
  // The token prompt, a wrong token refused, the right one taken.
  await giveToken(page, 'not-the-token');
  await page.locator('#token-error', { hasText: 'refused' }).waitFor({ timeout: 10000 });
  check(await page.locator('#token-dialog[open]').isVisible(), 'a wrong token is refused and asked for again');
  await page.fill('#token-input', token);
  await page.click('#token-form button[type=submit]');
  const row = page.locator('table.runs tbody tr', { has: page.locator(`a[href="/runs/${approved}"]`) });
  await row.waitFor({ timeout: 10000 });
  const rowText = await row.innerText();
  check(/WEB-1/.test(rowText) && /delivered/.test(rowText) && /implement-task/.test(rowText), `the list shows the approved run: ${rowText.replace(/\s+/g, ' ')}`);
  check(/\b2\b/.test(await row.locator('td[data-label=Cycles]').innerText()), 'the list counts its two review cycles');
  // The dispatcher samples the pool every 5 s, the page reads it every 3 s.
  await page.waitForFunction(() => /Workers\s*[1-9]/.test(document.getElementById('pool').innerText), null, { timeout: 15000 });
  check(true, 'the pool figures show the worker');
  const hosts = await page.locator('#pool .hosts').innerText();
  check(/^Hosts\s+\S+ [0-2]\/2$/.test(hosts.trim()), `the pool shows the worker's host with its busy and total slots: ${hosts}`);
  check(!page.url().includes(token), 'the token is not in the address');
  await page.selectOption('#filter-state', 'delivered');
  await page.fill('#filter-ticket', 'WEB-1');
  await page.click('form.filters button[type=submit]');
  await page.waitForFunction(() => document.querySelectorAll('table.runs tbody tr').length === 1);
  check(page.url().includes('state=delivered') && page.url().includes('ticket=WEB-1'), 'filters are kept in the address');
  await page.screenshot({ path: path.join(shots, 'runs.png'), fullPage: true });

  // The approved run's page.
  await page.goto(`${url}/runs/${approved}`);
  await page.locator('h2', { hasText: 'Report' }).waitFor({ timeout: 10000 });
  const text = await page.locator('main').innerText();
  check(/Review cycle 1(\/\d+)?:\s*REJECTED/.test(text), 'the first verdict, REJECTED');
  check(/Review cycle 2(\/\d+)?:\s*APPROVED/.test(text), 'the second verdict, APPROVED');
  check(text.includes('Missing tests for the feature: add tests.txt'), "the reviewer's feedback in full");
  const rounds = await page.locator('section', { has: page.locator('#h-rounds') }).innerText();
  check(/Round 1[\s\S]*test -f fixed\.txt[\s\S]*failed \(exit 1\)/.test(rounds), `the repair round's failing check: ${rounds.slice(0, 600)}`);
  const facts = await page.locator('dl.facts').innerText();
  check(/Branch\s*forge\/web-1/.test(facts), `the delivered branch: ${facts}`);
  check(text.includes('+++ b/tests.txt'), 'the change as a diff');
  check(/Implement · round 1/.test(text) && /Review · round \d · cycle 2/.test(text), 'the timeline of stages');
  await page.screenshot({ path: path.join(shots, 'run.png'), fullPage: true });

  // On a phone.
  const phone = await open(browser, { width: 390, height: 844 });
  await phone.page.goto(`${url}/`);
  await giveToken(phone.page, token);
  await phone.page.locator(`a[href="/runs/${approved}"]`).waitFor({ timeout: 10000 });
  const overflow = await phone.page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  check(overflow <= 1, `nothing is wider than a phone's screen (${overflow} px over)`);
  await phone.page.screenshot({ path: path.join(shots, 'runs-phone.png'), fullPage: true });
  await phone.context.close();

  // Hostile feedback is text: no script ran, nothing was loaded, the link is not a link.
  const before = requests.length;
  await page.goto(`${url}/runs/${hostile}`);
  await page.locator('.cycle').first().waitFor({ timeout: 10000 });
  const feedback = await page.locator('.cycle').first().innerText();
  check(feedback.includes('<script>window.__pwned = 1</script>'), 'the <script> is shown as text');
  check(feedback.includes('[image: tracker]'), 'the Markdown image is shown as its address');
  check(feedback.includes('<img src='), 'the <img> is shown as text');
  check(await page.evaluate(() => window.__pwned === undefined), 'no script of the feedback ran');
  check(await page.locator('main img, main script, main iframe').count() === 0, 'the page holds no image, script or frame');
  check(await page.locator('main a[href^="javascript:"]').count() === 0, 'no javascript: link');
  const elsewhere = requests.slice(before).filter((address) => !address.startsWith(url));
  check(elsewhere.length === 0, `every request went to the dispatcher (${elsewhere.join(', ') || 'none elsewhere'})`);
  check(errors.length === 0, `no script error on the pages (${errors.join('; ')})`);
  await context.close();
  await accessible(browser, url, token, [['/', 'table.runs tbody tr'], [`/runs/${approved}`, '.cycle']]);
}

/** axe-core's WCAG 2 A and AA rules on each page: no serious or critical violation (labels,
 * contrast, names, keyboard reach). Only this context may inject the rules' script: the
 * pages' policy refuses it everywhere else. */
async function accessible(browser, url, token, paths) {
  const context = await browser.newContext({ bypassCSP: true, viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  let asked = false;
  for (const [path, ready] of paths) {
    await page.goto(`${url}${path}`);
    if (!asked) { await giveToken(page, token); asked = true; }
    await page.locator(ready).first().waitFor({ timeout: 10000 });
    await page.addScriptTag({ path: require.resolve('axe-core/axe.min.js') });
    const result = await page.evaluate(() => window.axe.run(document, { runOnly: ['wcag2a', 'wcag2aa'] }));
    const serious = result.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical');
    const found = serious.map((v) => `${v.id}: ${v.nodes.slice(0, 3).map((n) => n.target.join(' ')).join(', ')}`);
    check(serious.length === 0, `${path} passes axe's WCAG 2 AA rules (${found.join('; ') || `${result.passes.length} rules pass`})`);
  }
  await context.close();
}

async function live(browser, url, token) {
  const run = env('RUN');
  const { page, context, errors } = await open(browser);
  await page.goto(`${url}/runs/${run}`);
  await giveToken(page, token);
  await page.locator('.timeline .running', { hasText: 'Implement · round 1' }).waitFor({ timeout: 20000 });
  await page.evaluate(() => { window.__same_page = true; });
  check(true, 'the page shows the implement stage running');
  await page.locator('.timeline li', { hasText: 'Review · round 1 · cycle 1' }).waitFor({ timeout: 60000 });
  check(await page.evaluate(() => window.__same_page === true), 'the page moved to the review stage by itself, without a reload');
  await page.locator('h1 .badge', { hasText: 'delivered' }).waitFor({ timeout: 60000 });
  check(true, 'and to the delivered state');
  check(errors.length === 0, `no script error (${errors.join('; ')})`);
  await context.close();
}

async function cancel(browser, url, token) {
  const run = env('RUN');
  const { page, context } = await open(browser);
  await page.goto(`${url}/runs/${run}`);
  await giveToken(page, token);
  const button = page.getByRole('button', { name: 'Cancel run' });
  await button.waitFor({ timeout: 20000 });
  await button.click();
  await page.getByRole('button', { name: 'Confirm cancel' }).click();
  await page.locator('h1 .badge', { hasText: 'cancelled' }).waitFor({ timeout: 60000 });
  check(true, 'the page shows the run cancelled');
  await context.close();
}

async function transcript(browser, url, token, shots) {
  const run = env('RUN');
  const agent = env('AGENT');
  const tool = env('TOOL');
  const { page, context, errors, requests } = await open(browser);
  await page.goto(`${url}/runs/${run}`);
  await giveToken(page, token);
  const stage = page.locator('details.stage', { hasText: 'Implement · round 1' }).first();
  await stage.waitFor({ timeout: 20000 });
  const summary = await stage.locator('summary').innerText();
  check(/\d+ in · \d+ out/.test(summary), `the stage's summary shows its tokens: ${summary}`);
  check(!(await stage.evaluate((node) => node.open)), 'the stage is collapsed at first');
  check(!requests.some((address) => address.includes('/transcript')), 'no transcript is fetched before a stage is opened');
  await stage.locator('summary').click();
  const entries = stage.locator('ol.transcript > li');
  await entries.first().waitFor({ timeout: 10000 });
  check(requests.some((address) => address.includes(`/v1/runs/${run}/stages/1/transcript`)), 'opening the stage fetched its transcript');
  const shown = await stage.locator('.transcript-body').innerText();
  check(shown.includes(agent), `the transcript names the agent kind ${agent}`);
  const call = stage.locator('ol.transcript > li.role-tool_call', { hasText: tool }).first();
  check(await call.count() === 1, `the transcript shows the ${tool} tool call`);
  check(await stage.locator('ol.transcript details[open]').count() === 0, 'every message and tool call is collapsed');
  await call.locator('summary').click();
  check(await call.locator('pre').isVisible(), 'a tool call opens to its input');
  check(await page.locator('ol.transcript > li.role-tool_result').count() >= 1, "the tool's result is shown");
  await page.screenshot({ path: path.join(shots, `transcript-${agent}.png`), fullPage: true });
  check(errors.length === 0, `no script error (${errors.join('; ')})`);
  await context.close();
}

(async () => {
  const url = env('URL');
  const token = env('TOKEN');
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--no-sandbox'],
  });
  try {
    const phase = env('PHASE');
    if (phase === 'finished') await finished(browser, url, token, env('SHOTS'));
    else if (phase === 'live') await live(browser, url, token);
    else if (phase === 'cancel') await cancel(browser, url, token);
    else if (phase === 'transcript') await transcript(browser, url, token, env('SHOTS'));
    else throw new Error(`unknown phase ${phase}`);
  } catch (error) {
    console.log(`FAILED: ${error.message}`);
    process.exitCode = 1;
  } finally {
    await browser.close();
  }
})();
