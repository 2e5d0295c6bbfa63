from .errors import KvcachedError as KvcachedError
from .kv_cache_manager import KVCacheManager as KVCacheManager
from .kv_cache_manager import KVGeometry as KVGeometry
from .ledger.ledger import Ledger as Ledger
from .settings import Settings as Settings

__version__: str
__all__ = ["KVCacheManager", "KVGeometry", "KvcachedError", "Ledger", "Settings", "__version__"]
