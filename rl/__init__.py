"""orthon.rl"""
