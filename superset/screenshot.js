// Screenshot Superset dashboards in headless Chromium (playwright-core, the system chromium).
//
//   NODE_PATH=build/screenshot-node/node_modules node superset/screenshot.js \
//       http://127.0.0.1:8089 admin admin build/screenshots slug1 slug2 ...
//
// Logs in through the login form, opens each dashboard (standalone), waits until every chart has
// rendered (no spinner left), saves build/screenshots/<slug>.png and prints one JSON line per
// dashboard: {slug, file, charts, rendered, errors: [...], texts: [...], steady, shots_ink: [...]}
// (shots_ink: the share of non-white pixels of each shot taken, the one kept last; steady: the last
// two were the same, with ink; see below).
const fs = require("fs");
const { chromium } = require("playwright-core");

const [base, user, password, outDir, ...slugs] = process.argv.slice(2);
const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";

// every chart holder has finished loading (no spinner inside any of them), then echarts' entry animation
async function waitForCharts(page) {
  await page.waitForFunction(() => {
    const holders = document.querySelectorAll(".dashboard-component-chart-holder");
    if (!holders.length) return false;
    return Array.from(holders).every((h) => !h.querySelector(".loading, [data-test='loading-indicator']")
      && (h.querySelector("canvas, svg, table, .superset-legacy-chart-big-number, .big_number_total, .header-line")
          || h.innerText.trim().length > 0));
  }, null, { timeout: 120000, polling: 500 });
  await page.waitForTimeout(1500);
}

// The share of non-white pixels of a PNG (as tests/superset's _png_stats counts them: on a copy 400
// pixels wide, a pixel is ink when its darkest channel is below 235), decoded by the browser itself in
// a blank page of its own, so that node needs no image library and the dashboard is not touched.
const MIN_INK = 0.05;
async function inkShare(checker, png) {
  return checker.evaluate(async (b64) => {
    const img = new Image();
    img.src = `data:image/png;base64,${b64}`;
    await img.decode();
    const width = 400;
    const height = Math.max(1, Math.floor((img.height * width) / img.width));
    const canvas = document.createElement("canvas");
    canvas.width = width;
    canvas.height = height;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(img, 0, 0, width, height);
    const px = ctx.getImageData(0, 0, width, height).data;
    let ink = 0;
    for (let i = 0; i < px.length; i += 4) {
      if (Math.min(px[i], px[i + 1], px[i + 2]) < 235) ink += 1;
    }
    return ink / (width * height);
  }, png.toString("base64"));
}

(async () => {
  const browser = await chromium.launch({
    executablePath,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"],
  });
  try {
    const viewport = { width: 1600, height: 1200 };
    const page = await browser.newPage({ viewport });
    const checker = await browser.newPage(); // about:blank, for inkShare
    // No request the login page sent with its anonymous session cookie may be answered after the
    // login's: Superset answers it with that anonymous session in a Set-Cookie, which undoes the login,
    // and /superset/welcome/ then sends the browser back to /login/?next=... (2 of 13 `make
    // superset-check` runs here and one in CI, 2026-12-03). Seen: the frontend's event log, which the
    // page posts to /superset/log/ as it unloads for the login's redirect (answered 302 with a new
    // session 62 ms after the login's 302). So that post is answered here, in the browser, until the
    // login is judged; and the page's own requests are done before the form is posted (networkidle).
    const eventLog = "**/superset/log/**";
    await page.route(eventLog, (route) => route.fulfill({ status: 204 }));
    // every response until the login is judged, for the error when it does not hold
    const trail = [];
    const t0 = Date.now();
    const onResponse = async (r) => {
      const url = new URL(r.url());
      if (url.pathname.startsWith("/static/")) return;
      const cookie = (await r.headerValue("set-cookie").catch(() => null)) || "";
      trail.push(`${Date.now() - t0}ms ${r.request().method()} ${url.pathname}${url.search} ${r.status()}`
        + `${cookie ? ` set-cookie ${cookie.split("=")[0]} (${cookie.length} B)` : ""}`);
    };
    page.on("response", onResponse);
    await page.goto(`${base}/login/`, { waitUntil: "networkidle" });
    await page.fill("input[name=username], #username", user);
    await page.fill("input[name=password], #password", password);
    await Promise.all([
      // the first page after login is Superset's slowest on a cold start (seen > 60 s on 2 busy cores)
      page.waitForNavigation({ timeout: 180000 }),
      page.keyboard.press("Enter"),
    ]);
    if (new URL(page.url()).pathname.startsWith("/login")) {
      await page.waitForTimeout(1000); // the last responses' headers
      throw new Error(`the login did not hold: the form post ended on ${page.url()}; responses:\n${trail.join("\n")}`);
    }
    page.off("response", onResponse);
    await page.unroute(eventLog);
    for (const slug of slugs) {
      await page.setViewportSize(viewport); // each dashboard from the same size (the last one grew it)
      await page.goto(`${base}/superset/dashboard/${slug}/?standalone=1`, { waitUntil: "domcontentloaded" });
      await page.waitForSelector(".dashboard-component-chart-holder", { timeout: 90000 });
      await waitForCharts(page);
      // A full-page screenshot grows the viewport to the page, and Superset lays the grid out again
      // (charts outside the old viewport mount, the others resize): a shot taken during that showed an
      // empty grid. So grow the viewport first and wait for every chart again; the shot then resizes nothing.
      const height = await page.evaluate(() => document.documentElement.scrollHeight);
      if (height > viewport.height) {
        await page.setViewportSize({ width: viewport.width, height });
        await waitForCharts(page);
      }
      const info = await page.evaluate(() => {
        const holders = Array.from(document.querySelectorAll(".dashboard-component-chart-holder"));
        const errors = holders.flatMap((h) => Array.from(h.querySelectorAll(".alert, [role=alert], .error-message"))
          .map((e) => e.innerText.trim()).filter(Boolean));
        const rendered = holders.filter((h) => h.querySelector("canvas, svg, table")
          || /\d/.test(h.innerText)).length;
        // what each chart shows as text (tables, big numbers, axis labels): checked for unrounded numbers
        const texts = holders.map((h) => h.innerText.trim()).filter(Boolean);
        return { charts: holders.length, rendered, errors, texts };
      });
      // Chromium now and then captures a frame in which the dashboard's grid is not painted, or only in
      // part, while the page does not change (the same charts, no spinner, the same height): a blank
      // cockpit failed `make superset-check` once, and in 8 runs with both cores busy (2026-12-03) 4 of
      // 24 dashboards had a blank shot (ink 0.3-0.5 %, 14-17 % when drawn), then a partial one (10-12 %).
      // So a shot is kept only once it has ink and equals the one before it byte for byte; `shots_ink`
      // lists the ink share of every shot taken, the kept one last (at most 10, a second apart).
      const file = `${outDir}/${slug}.png`;
      let png = await page.screenshot({ fullPage: true });
      const shotsInk = [await inkShare(checker, png)];
      let steady = false;
      while (!steady && shotsInk.length < 10) {
        await page.waitForTimeout(1000);
        const next = await page.screenshot({ fullPage: true });
        const same = next.equals(png); // the same bytes have the same ink: no second decode
        shotsInk.push(same ? shotsInk[shotsInk.length - 1] : await inkShare(checker, next));
        steady = same && shotsInk[shotsInk.length - 1] >= MIN_INK;
        png = next;
      }
      fs.writeFileSync(file, png);
      const shots_ink = shotsInk.map((x) => Number(x.toFixed(4)));
      console.log(JSON.stringify({ slug, file, ...info, steady, shots_ink }));
    }
  } finally {
    await browser.close();
  }
})().catch((err) => {
  console.error(err && err.stack ? err.stack : String(err));
  process.exit(1);
});
