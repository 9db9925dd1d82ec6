"""The Python API from a script or a notebook cell: train, then read the results.

    python examples/train_from_python.py              # a local Ray is started for you
    RAY_ADDRESS=HOST:6379 python examples/train_from_python.py   # or join a running cluster

Plain `mp.spawn` DDP is known to hang in notebooks; here the workers are Ray
actors, so the same call works from Jupyter. Sizes are small so that it runs
in about a minute on a laptop; drop them for the full built-in default.
"""

from raytrain_ddp import TrainConfig, fit

config = TrainConfig(
    num_workers=2,  # one worker per GPU with use_gpu=True, else per CPU slot
    epochs=2,
    train_size=2048,  # rows of the built-in synthetic image set
    val_size=512,
    batch_size=64,  # per worker: the global batch is 64 x 2 = 128
    storage_path="runs",
    name="from-python",
    report=False,
)
result = fit(config)

print("status:", result.summary["status"])
print("global batch:", result.summary["global_batch_size"])
for epoch in result.epochs:
    print(
        f"epoch {epoch['epoch']}: train loss {epoch['train_loss']:.3f} "
        f"(ranks {epoch['train_loss_min']:.3f}..{epoch['train_loss_max']:.3f}), "
        f"val accuracy {epoch['val_accuracy']:.3f}"
    )
print("best checkpoint:", result.best_checkpoint)
print("replicas identical:", result.summary["replicas_identical"])
