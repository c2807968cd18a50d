"""The simulator: `monarch.Simulator` (`simulator`), its backend (`backend`), cost model (`model`,
`costs`), device profiles (`devices`), trace output (`chrome`) and calibration's controller half
(`calibration`; the worker half is `worker/calibration.py`)."""
