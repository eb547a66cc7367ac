"""The `fusedzero` command and what only it uses, apart from the library: `fusedzero train`
(config, launch, loop, resume, summary) with its GPT model and byte-level data, the `ckpt`
subcommand, the run-folder lock and the launcher/rank life cycle."""

import warnings

# The application's own warning policy (the library sets none). numpy is not a dependency, but
# `import torch` warns "Failed to initialize NumPy" when it is missing (once per process: the
# launcher and every spawned rank of `fusedzero train`). Nothing here needs numpy, so that one
# warning is filtered by its exact message; this package is imported before torch is.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
