"""Drop-ins for the trainers people already run (docs/integrations.md):

    fusedzero.integrations.hf.ZeroTrainer          transformers.Trainer, `pip install 'fusedzero[hf]'`
    fusedzero.integrations.lightning.ZeroStrategy  Lightning 2.x, `pip install 'fusedzero[lightning]'`

Each module imports its framework when it is imported itself; this package and the core import
neither, so `import fusedzero` stays free of transformers and lightning.
"""
