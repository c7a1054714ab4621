from verifiers_warehouse.taskset import WarehouseTaskset

__all__ = ["WarehouseTaskset"]
