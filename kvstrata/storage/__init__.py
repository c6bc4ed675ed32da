"""The storage tier (L3): page backends behind one interface (`base.create_backend("file" | "mooncake")`).

Kept free of imports so that the Mooncake service harness can run without loading torch.
"""
