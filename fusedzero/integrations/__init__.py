"""Drop-ins for the trainers people already run (docs/integrations.md):

    fusedzero.integrations.hf.ZeroTrainer          the transformers Trainer   (extra: hf)
    fusedzero.integrations.lightning.ZeroStrategy  a Lightning 2.x strategy   (extra: lightning)

Each module imports its framework when it is imported itself; this package and the core import
neither, so `import fusedzero` stays free of transformers and lightning.
"""
