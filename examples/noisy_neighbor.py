"""Five-minute demo: a noisy tenant cannot starve a quiet one.

Run a broker (`./scripts/serve.sh`), create the queue with the CLI:

    fila queue create demo --on-enqueue @examples/tenant_fairness.lua

then run this script (it talks to $FILA_ADDR, like the CLI, else localhost:5555,
or to the address given as its first argument). The noisy tenant enqueues 100
messages before the quiet tenant enqueues 5; a FIFO broker would deliver the quiet
ones last (positions 101-105). Fila's DRR scheduler alternates between tenants, so
they arrive among the first dozen deliveries.
"""

from __future__ import annotations

import os
import sys

from fila_sdk import Client


def main(addr: str = os.environ.get("FILA_ADDR", "localhost:5555"), queue: str = "demo") -> None:
    with Client(addr) as client:
        for i in range(100):
            client.enqueue(queue, {"tenant": "noisy"}, f"noisy-{i}".encode())
        for i in range(5):
            client.enqueue(queue, {"tenant": "quiet"}, f"quiet-{i}".encode())

        quiet_positions = []
        for position, message in enumerate(client.consume(queue), start=1):
            client.ack(queue, message.id)
            if message.fairness_key == "quiet":
                quiet_positions.append(position)
                print(f"delivery {position:3d}: {message.payload.decode()}")
            if position == 105:
                break
        print(f"quiet tenant's 5 messages arrived at deliveries {quiet_positions}")


if __name__ == "__main__":
    main(*sys.argv[1:])
