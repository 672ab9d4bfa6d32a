from inventory.reservations import OutOfStock, reserve


class Item:
    def __init__(self, name, stock):
        self.name = name
        self.stock = stock


def test_reserve_takes_stock():
    item = Item("mug", 3)
    assert reserve(item, 2) == 1


def test_reserve_rejects_negative_quantities():
    item = Item("mug", 3)
    try:
        reserve(item, -1)
    except ValueError:
        assert item.stock == 3
    else:
        raise AssertionError("a negative quantity was accepted")
