"""The `fusedzero` command and what only it uses, apart from the library: `fusedzero train`
(config, launch, loop, resume, summary) with its GPT model and byte-level data, the `ckpt`
subcommand, the run-folder lock and the launcher/rank life cycle."""
