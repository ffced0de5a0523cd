import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { describe, expect, it } from "vitest";
import { fetchDaemonStatus } from "./status.js";

describe("fetchDaemonStatus", () => {
  it("reads /v1/status with the bearer key, and gives undefined on errors", async () => {
    const seen: Array<string | undefined> = [];
    const server = createServer((req, res) => {
      seen.push(req.headers.authorization);
      if (req.headers.authorization !== "Bearer k") {
        res.writeHead(401).end();
        return;
      }
      res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ adapter_version: "v1", training: { samples_ready: 3, batch_size: 16, last_step: null } }));
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    try {
      expect(await fetchDaemonStatus(url, "k")).toEqual({ adapter_version: "v1", training: { samples_ready: 3, batch_size: 16, last_step: null } });
      expect(await fetchDaemonStatus(url, "wrong")).toBeUndefined();
      expect(seen).toEqual(["Bearer k", "Bearer wrong"]);
    } finally {
      await new Promise((r) => server.close(r));
    }
    expect(await fetchDaemonStatus(url, "k", 500)).toBeUndefined(); // nothing listening
  });
});
