"""Stock reservations for the shop."""


class OutOfStock(Exception):
    """Raised when a reservation asks for more than is in stock."""


def reserve(item, quantity):
    """Reserve `quantity` units of `item` and return the stock left."""
    if quantity < 0:
        raise ValueError("quantity must not be negative")
    if quantity > item.stock:
        raise OutOfStock(item.name)
    item.stock -= quantity
    return item.stock
