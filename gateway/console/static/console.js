// Live parts: an element with data-live="URL" is refilled from URL two
// seconds after its last refill ended, or data-every milliseconds after (an
// HTML fragment of the same page); with data-load, also once as the page
// opens. A slow or failed fetch delays the next, never stacks them.
"use strict";
for (const element of document.querySelectorAll("[data-live]")) {
  const every = Number(element.dataset.every) || 2000;
  const refill = async () => {
    try {
      const answer = await fetch(element.dataset.live, {credentials: "same-origin"});
      if (answer.ok && answer.headers.get("content-type")?.startsWith("text/html")) {
        element.innerHTML = await answer.text();
      }
    } catch (failure) {
      // the gateway is away for a moment: the next tick tries again
    }
    setTimeout(refill, every);
  };
  if ("load" in element.dataset) {
    refill();
  } else {
    setTimeout(refill, every);
  }
}
