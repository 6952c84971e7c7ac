"""The family registry's former names (the registry is models/spec.py), for code that imports them."""

from shardzoo.models.spec import REGISTRY as FAMILIES
from shardzoo.models.spec import FamilySpec as Family
from shardzoo.models.spec import spec_named as family_named
from shardzoo.models.spec import spec_of as family_of

__all__ = ["FAMILIES", "Family", "family_named", "family_of"]
