"""anyio 4.16, asyncio: from_thread.run() started after the host task's scope was cancelled
spins forever in checkpoint_if_cancelled() (cancellation is never delivered to the new task)."""
import os, sys, threading, time
import anyio, anyio.to_thread, anyio.from_thread, anyio.lowlevel

async def inner() -> str:
    await anyio.lowlevel.checkpoint_if_cancelled()
    return "returned"

def worker(go: threading.Event) -> str:
    go.wait(5)
    try:
        return anyio.from_thread.run(inner)
    except BaseException as exc:
        return f"raised {type(exc).__name__}"

async def main() -> None:
    go = threading.Event()
    with anyio.CancelScope() as scope:
        async def cancel_then_release() -> None:
            await anyio.sleep(0.05)
            scope.cancel()
            await anyio.sleep(0.05)      # let the delivery attempt finish
            go.set()                     # only now does the thread call from_thread.run
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_then_release)
            print("worker:", await anyio.to_thread.run_sync(worker, go))

def watchdog() -> None:
    time.sleep(10)
    print("HANG: from_thread.run never returned", flush=True)
    os._exit(1)

threading.Thread(target=watchdog, daemon=True).start()
anyio.run(main, backend=sys.argv[1])
print("done", flush=True)
