"""fusedzero"""
