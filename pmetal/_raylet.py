"""Ray's ``ray._raylet`` import path for the names scripts import from it
(``from ray._raylet import ObjectRefGenerator``, as Ray's own generator
examples do; ``DynamicObjectRefGenerator`` lives there in Ray too), so that ``import pmetal as ray`` keeps them working. Nothing
else lives here."""

from pmetal.actors.dynamic import DynamicObjectRefGenerator
from pmetal.actors.generators import ObjectRefGenerator
from pmetal.actors.refs import ObjectRef

StreamingObjectRefGenerator = ObjectRefGenerator
"""The name Ray 2.7 and earlier used."""

__all__ = ["DynamicObjectRefGenerator", "ObjectRef", "ObjectRefGenerator",
           "StreamingObjectRefGenerator"]
