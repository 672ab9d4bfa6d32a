from inventory.reservations import OutOfStock, reserve


class Item:
    def __init__(self, name, stock):
        self.name = name
        self.stock = stock


def test_reserve_takes_stock():
    item = Item("mug", 3)
    assert reserve(item, 2) == 1
