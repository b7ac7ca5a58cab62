"""orthon.optim"""
