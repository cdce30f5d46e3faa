// Live parts: an element with data-live="URL" is refilled from URL every two
// seconds, or every data-every milliseconds (an HTML fragment of the same
// page); with data-load, also once as the page opens. A failed fetch waits
// for the next.
"use strict";
for (const element of document.querySelectorAll("[data-live]")) {
  const refill = async () => {
    try {
      const answer = await fetch(element.dataset.live, {credentials: "same-origin"});
      if (answer.ok && answer.headers.get("content-type")?.startsWith("text/html")) {
        element.innerHTML = await answer.text();
      }
    } catch (failure) {
      // the gateway is away for a moment: the next tick tries again
    }
  };
  if ("load" in element.dataset) {
    refill();
  }
  setInterval(refill, Number(element.dataset.every) || 2000);
}
