"""The facts the control plane and the workers share, in one torch-free place.

Why a package of its own: the SDK and the control plane must import without torch, the
workers must not import the service (imports run ``migrations → service → workers →
contract``), yet both sides read the same job spec, the same presets, the same metric
fields, the same stage traits and the same failure reasons. Each of those is written once
here and everything else derives from it. Depends on pydantic and the standard library only.
"""
