// Times the web view's pages in Debian's Chromium (for scripts/bench-view.py): for `/` and a
// run's page, each loaded cold (a new browser context) REPEATS times, the first contentful
// paint and the time until the data is on the page (the runs table filled; the run's cycles
// and log shown). Prints the medians.
'use strict';

const { chromium } = require('playwright-core');

const median = (values) => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
};

async function time(browser, url, ready) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  const started = Date.now();
  await page.goto(url);
  await page.waitForFunction(ready, null, { timeout: 30000 });
  const shown = Date.now() - started;
  const paint = await page.evaluate(() => {
    const entry = performance.getEntriesByName('first-contentful-paint')[0];
    return entry ? entry.startTime : NaN;
  });
  await context.close();
  return { paint, shown };
}

(async () => {
  const url = process.env.URL;
  const run = process.env.RUN;
  const repeats = Number(process.env.REPEATS || 7);
  const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', args: ['--no-sandbox'] });
  const pages = [
    ['/ (10,000 runs)', `${url}/`, () => document.querySelectorAll('table.runs tbody tr').length === 50],
    [`/runs/{id} (200 cycles, 100,000 log lines)`, `${url}/runs/${run}`,
      () => document.querySelectorAll('.cycle').length === 200 && document.querySelector('pre.log').textContent.length > 1000],
  ];
  for (const [name, address, ready] of pages) {
    const results = [];
    for (let i = 0; i < repeats; i += 1) results.push(await time(browser, address, ready));
    console.log(`${name}: first contentful paint ${median(results.map((r) => r.paint)).toFixed(0)} ms, data shown ${median(results.map((r) => r.shown))} ms (median of ${repeats})`);
  }
  await browser.close();
})().catch((error) => { console.error(error); process.exit(1); });
