"""Dataset format, converters and driver-side validation (no Ray imports here).

`format` defines the on-disk contract, `prepare` converts sources into it,
`validate` checks Parquet inputs before any worker starts. Run
`python -m raytrain_ddp.data --help` for the converter and inspector CLI.
"""
