#!/usr/bin/env node
// Sends a Workflow Update through the real Temporal Web UI, the way a person would: the workflow's
// page -> More Actions -> Send an Update -> Name -> Data (JSON) -> Submit.
//
//   node tests/webui/send_update.mjs --ui http://127.0.0.1:8233 --namespace default \
//        --workflow-id ID --name NAME --json '{"reviewer": "ada", "decision": "approve"}' \
//        [--screenshots DIR] [--expect-error] [--timeout SECONDS] [--expect-text TEXT]
//
// Prints one JSON line on stdout and exits 0 once the dialog showed an outcome:
//   {"ok": true, "toast": "Update successful", "stage": "..._COMPLETED", ...}
//       the dialog closed AND the server's answer to the UI's update call had outcome.success
//   {"ok": false, "error": "...", "stack_trace": "...", ...}
//       the dialog showed an error (e.g. the Update validator's message, with the trace under it),
//       or the dialog closed saying "Update successful" although the server answered with no
//       outcome (Web UI 2.54 does that when no worker accepted the Update within ~20 s)
//   "name_mode" says how the name was entered: "dropdown", "custom" (dropdown's Custom) or "text".
// --expect-text TEXT: the workflow page must show TEXT (e.g. a decoded input: with a codec endpoint the
// UI decodes payloads through it) before anything else is done; the line then has "text_seen": true.
// --expect-error only says which outcome the caller expects: the line then has "expected": true|false
// (exit code still 0). Exits 1 with a message on stderr when the page could not be driven to an
// outcome (UI unreachable, workflow not found, a control missing, no outcome in time), 2 on bad args.
//
// Browser: Debian's /usr/bin/chromium through playwright-core (no Playwright browser download),
// headless, with the flags of shared/notes/temporal.md and a fresh --user-data-dir in a temp dir.
// Checked against Temporal Web UI 2.54.1 (CLI 1.9.1).

import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { chromium } from 'playwright-core';

const CHROMIUM = process.env.RAGLINE_CHROMIUM || '/usr/bin/chromium';
const LAUNCH_FLAGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];
const STEP_MS = 15_000;    // any single wait on the page
// Chromium's start: on a busy 2-core machine (a CI run's other tests beside it) it once took over 15 s.
const LAUNCH_MS = 45_000;
const OUTCOME_MS = 25_000; // from Submit to "dialog closed" or "error shown" (server waits ~20 s)

class DriveError extends Error {}

function usage(msg) {
  process.stderr.write(`send_update.mjs: ${msg}\n` +
    'usage: node send_update.mjs --ui URL --workflow-id ID --name NAME --json JSON ' +
    '[--namespace NS] [--screenshots DIR] [--expect-error] [--timeout SECONDS]\n');
  process.exit(2);
}

function parse() {
  let values;
  try {
    ({ values } = parseArgs({
      options: {
        ui: { type: 'string' },
        namespace: { type: 'string', default: 'default' },
        'workflow-id': { type: 'string' },
        name: { type: 'string' },
        json: { type: 'string' },
        screenshots: { type: 'string' },
        'expect-error': { type: 'boolean', default: false },
        timeout: { type: 'string', default: '60' },
        'expect-text': { type: 'string' },
      },
      strict: true,
    }));
  } catch (e) {
    usage(e.message);
  }
  for (const k of ['ui', 'workflow-id', 'name', 'json']) if (!values[k]) usage(`--${k} is required`);
  let payload;
  try {
    payload = JSON.parse(values.json);
  } catch (e) {
    usage(`--json is not valid JSON: ${e.message}`);
  }
  const timeout = Number(values.timeout);
  if (!(timeout > 0)) usage('--timeout must be a positive number of seconds');
  return { ...values, payload, timeoutMs: timeout * 1000 };
}

// Deep equality of two parsed JSON values (key order ignored).
function sameJson(a, b) {
  if (a === b) return true;
  if (typeof a !== 'object' || typeof b !== 'object' || a === null || b === null) return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  const ka = Object.keys(a), kb = Object.keys(b);
  return ka.length === kb.length && ka.every((k) => Object.hasOwn(b, k) && sameJson(a[k], b[k]));
}

async function drive(page, args, shot) {
  const url = `${args.ui.replace(/\/+$/, '')}/namespaces/${encodeURIComponent(args.namespace)}` +
    `/workflows/${encodeURIComponent(args['workflow-id'])}`;
  try {
    // The UI polls forever: 'networkidle' never comes.
    await page.goto(url, { waitUntil: 'load', timeout: STEP_MS });
  } catch (e) {
    throw new DriveError(`could not load ${url}: ${e.message.split('\n')[0]}`);
  }

  // The page renders the header twice (wide and narrow layouts): always take the visible one.
  const more = page.getByRole('button', { name: 'More Actions' }).filter({ visible: true }).first();
  try {
    await more.waitFor({ state: 'visible', timeout: STEP_MS });
  } catch {
    const heading = (await page.locator('h1, h2').filter({ visible: true }).allInnerTexts()
      .catch(() => [])).join(' | ');
    throw new DriveError(`no "More Actions" button on ${url} (workflow not found? page says: ` +
      `${heading.slice(0, 200) || 'nothing'})`);
  }
  if (args['expect-text']) {
    try {
      await page.getByText(args['expect-text']).filter({ visible: true }).first().waitFor({ state: 'visible', timeout: STEP_MS });
      args.textSeen = true;
    } catch {
      throw new DriveError(`the workflow page does not show ${JSON.stringify(args['expect-text'])} (not decoded?)`);
    }
  }
  await shot('01-workflow-page');

  await more.click({ timeout: STEP_MS });
  const item = page.getByRole('menuitem', { name: 'Send an Update' }).filter({ visible: true }).first();
  try {
    await item.waitFor({ state: 'visible', timeout: STEP_MS });
  } catch {
    throw new DriveError('the More Actions menu has no visible "Send an Update" item ' +
      '(the server may have Updates disabled, or the workflow is closed)');
  }
  await shot('02-more-actions-menu');
  await item.click({ timeout: STEP_MS });

  const dialog = page.locator('dialog[open]').filter({ hasText: 'Send an Update' });
  await dialog.waitFor({ state: 'visible', timeout: STEP_MS });

  // Name: a dropdown filled from the workflow's metadata query (needs a running worker), whose
  // last option "Custom" turns it into a text box; or directly a text box when there is no metadata.
  const select = dialog.getByTestId('update-select-button');
  const freeText = dialog.getByTestId('update-name');
  await select.or(freeText).first().waitFor({ state: 'visible', timeout: STEP_MS });
  if (!(await select.isVisible())) {
    // The metadata query may still be answering: give the dropdown a moment to replace the box.
    await select.waitFor({ state: 'visible', timeout: 1500 }).catch(() => {});
  }
  let nameMode;
  if (await select.isVisible()) {
    await select.click({ timeout: STEP_MS });
    const option = dialog.getByRole('option', { name: args.name, exact: true });
    const custom = dialog.getByRole('option', { name: 'Custom', exact: true });
    await option.or(custom).first().waitFor({ state: 'visible', timeout: STEP_MS });
    if (await option.isVisible()) {
      await option.click({ timeout: STEP_MS });
      nameMode = 'dropdown';
    } else {
      await custom.click({ timeout: STEP_MS });
      await freeText.waitFor({ state: 'visible', timeout: STEP_MS });
      await freeText.fill(args.name, { timeout: STEP_MS });
      nameMode = 'custom';
    }
  } else {
    await freeText.fill(args.name, { timeout: STEP_MS });
    nameMode = 'text';
  }

  // Data: a CodeMirror editor (contenteditable, aria-label "Data"). Insert the JSON as one text
  // input, like a paste, not key by key, so that no editor feature (auto-indent, bracket closing)
  // rewrites it; what the editor then holds is checked against the payload below.
  const editor = dialog.getByRole('textbox', { name: 'Data' });
  await editor.click({ timeout: STEP_MS });
  await page.keyboard.press('ControlOrMeta+A');
  await page.keyboard.press('Delete');
  await page.keyboard.insertText(args.json);
  // The editor reformats its content when it loses focus; Submit clicked while it still has focus
  // races that reflow. Tab moves the focus out first.
  await page.keyboard.press('Tab');
  await page.waitForTimeout(200);
  const shown = await editor.innerText();
  let shownJson;
  try {
    shownJson = JSON.parse(shown);
  } catch {
    throw new DriveError(`the Data editor does not hold valid JSON after filling it: ${JSON.stringify(shown)}`);
  }
  if (!sameJson(shownJson, args.payload)) {
    throw new DriveError(`the Data editor holds ${JSON.stringify(shownJson)}, not the given payload`);
  }

  const submit = dialog.getByTestId('confirm-modal-button');
  await shot('03-dialog-filled');
  try {
    await page.waitForFunction((el) => !el.disabled, await submit.elementHandle(), { timeout: 5000 });
  } catch {
    const hints = (await dialog.locator('[role=alert]').allInnerTexts()).map((s) => s.trim()).filter(Boolean);
    return { ok: false, error: `Submit stays disabled${hints.length ? `: ${hints.join('; ')}` : ''}`, name_mode: nameMode };
  }

  // The UI's own call to the server (POST /api/v1/namespaces/NS/workflows/ID/update/NAME). Needed
  // because Web UI 2.54 also says "Update successful" when the server's wait ran out with no
  // outcome (no worker accepted the Update within ~20 s): only outcome.success is a real success.
  const answer = page.waitForResponse(
    (r) => r.request().method() === 'POST' && /\/workflows\/.+\/update\/[^/]+$/.test(new URL(r.url()).pathname),
    { timeout: OUTCOME_MS },
  ).then(async (r) => ({ status: r.status(), body: await r.json().catch(() => null) }), () => null);
  await submit.click({ timeout: STEP_MS });

  // Outcome on the page: the dialog closes (with a toast) or an alert with text appears inside it.
  // The form's own <p role=alert> is there but empty while nothing is wrong.
  const started = Date.now();
  while (Date.now() - started < OUTCOME_MS) {
    if (!(await dialog.isVisible())) {
      const toast = page.getByText('Update successful', { exact: true }).filter({ visible: true }).first();
      const toastShown = await toast.waitFor({ state: 'visible', timeout: 3000 }).then(() => true, () => false);
      await shot('04-after-submit');
      const server = await answer;
      const body = server?.body ?? {};
      const result = { ok: false, toast: toastShown ? 'Update successful' : null, stage: body.stage ?? null, name_mode: nameMode };
      if (body.outcome?.success) {
        result.ok = true;
      } else if (body.outcome?.failure) {
        result.error = body.outcome.failure.message || 'the Update failed';
      } else {
        result.error = `the dialog closed${toastShown ? ' saying "Update successful"' : ''}, but the server ` +
          `answered ${server ? `HTTP ${server.status} with no outcome (stage ${body.stage ?? 'none'})` : 'nothing'}: ` +
          'no worker has accepted the Update';
      }
      return result;
    }
    const alerts = dialog.locator('[role=alert]').filter({ visible: true });
    const n = await alerts.count();
    for (let i = 0; i < n; i++) {
      const alert = alerts.nth(i);
      const text = (await alert.innerText()).trim();
      if (!text) continue;
      // A failure is a message <p> followed by an optional read-only "Stack Trace" editor.
      const trace = alert.getByRole('textbox', { name: 'Stack Trace' });
      const stack = (await trace.count()) ? (await trace.innerText()).trim() : null;
      const msg = (await alert.locator('p').count()) ? (await alert.locator('p').first().innerText()).trim() : text;
      await shot('04-after-submit');
      const server = await Promise.race([answer, new Promise((res) => setTimeout(() => res(null), 2000))]);
      return { ok: false, error: msg || text, stack_trace: stack, stage: server?.body?.stage ?? null, name_mode: nameMode };
    }
    await page.waitForTimeout(100);
  }
  await shot('04-after-submit');
  throw new DriveError(`no outcome ${OUTCOME_MS / 1000} s after Submit (is a worker polling the task queue?)`);
}

async function main() {
  const args = parse();
  const t0 = Date.now();
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'ragline-webui-'));
  let context;
  const watchdog = setTimeout(() => {
    process.stderr.write(`send_update.mjs: gave up after ${args.timeoutMs / 1000} s\n`);
    // Playwright ends the Chromium it launched when this process exits.
    fs.rmSync(userDataDir, { recursive: true, force: true });
    process.exit(1);
  }, args.timeoutMs);
  let code = 0;
  try {
    if (!fs.existsSync(CHROMIUM)) throw new DriveError(`${CHROMIUM} is missing (\`make test\` installs Debian's chromium)`);
    if (args.screenshots) fs.mkdirSync(args.screenshots, { recursive: true });
    context = await chromium.launchPersistentContext(userDataDir, {
      executablePath: CHROMIUM, headless: true, args: LAUNCH_FLAGS,
      viewport: { width: 1280, height: 860 }, timeout: LAUNCH_MS,
    });
    const page = context.pages()[0] ?? (await context.newPage());
    page.setDefaultTimeout(STEP_MS);
    // SEND_UPDATE_DEBUG=1: timings of the stages and the UI's POSTs to the server, on stderr.
    const debug = process.env.SEND_UPDATE_DEBUG ? (m) => process.stderr.write(`[${Date.now() - t0} ms] ${m}\n`) : null;
    if (debug) {
      page.on('request', (r) => { if (r.method() === 'POST') debug(`POST ${r.url()} ${r.postData()}`); });
      page.on('response', async (r) => {
        if (r.request().method() === 'POST') debug(`${r.status()} ${r.url()} ${(await r.text().catch(() => '')).slice(0, 600)}`);
      });
    }
    const shot = async (stage) => {
      debug?.(`stage ${stage}`);
      if (args.screenshots) await page.screenshot({ path: path.join(args.screenshots, `${stage}.png`) });
    };
    const result = await drive(page, args, shot);
    if (args['expect-error']) result.expected = !result.ok;
    if (args['expect-text']) result.text_seen = Boolean(args.textSeen);
    process.stdout.write(JSON.stringify(result) + '\n');
  } catch (e) {
    process.stderr.write(`send_update.mjs: ${e instanceof DriveError ? e.message : e.stack || e}\n`);
    code = 1;
  } finally {
    clearTimeout(watchdog);
    await context?.close().catch(() => {});
    fs.rmSync(userDataDir, { recursive: true, force: true });
  }
  process.exit(code);
}

main();
