"""AdamW vs LoGRA peak memory and step time: the same as `logra bench memory` (see --help)."""
from logra.bench.memory import main

raise SystemExit(main())
